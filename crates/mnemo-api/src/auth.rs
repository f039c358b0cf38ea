//! Bearer tokens: HS256 with a shared secret, or RS256/ES256 with a public key. The verified
//! claims become a [`Principal`]; nothing else in a request can name a tenant.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use mnemo_config::JwtKey;
use mnemo_core::{AgentId, Label, Principal, SessionId, TenantId, UserId};
use serde::{Deserialize, Serialize};

use crate::{ApiError, AppState};

/// The claims mnemo reads. Other claims (iss, iat, …) may be present and are ignored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sub: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sid: Option<String>,
    /// Roles that open memories written with `allowed_roles`. Read leniently: identity providers
    /// put their own roles here, so entries mnemo cannot use are ignored, never refused.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub roles: serde_json::Value,
    /// A number of seconds, which RFC 7519 allows to have a fraction (jsonwebtoken checks it).
    pub exp: serde_json::Number,
}

/// Verifies tokens with the deployment's keys: one, or during a rotation, the current and the
/// previous one (each with the validation of its own algorithm).
#[derive(Clone)]
pub struct Authenticator {
    keys: Vec<(DecodingKey, Validation)>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let algorithms: Vec<_> = self.keys.iter().flat_map(|(_, v)| v.algorithms.clone()).collect();
        f.debug_struct("Authenticator").field("algorithms", &algorithms).finish_non_exhaustive()
    }
}

/// The PEM blocks of a file (`-----BEGIN …-----` to `-----END …-----`), each whole; `Err` with
/// the number of a block cut short (no END line: a key pasted in part).
fn pem_blocks(pem: &[u8]) -> Result<Vec<&[u8]>, usize> {
    const BEGIN: &[u8] = b"-----BEGIN ";
    const END: &[u8] = b"-----END ";
    let find = |haystack: &[u8], needle: &[u8]| haystack.windows(needle.len()).position(|w| w == needle);
    let mut blocks = Vec::new();
    let mut rest = pem;
    while let Some(start) = find(rest, BEGIN) {
        let Some(end) = find(&rest[start..], END) else { return Err(blocks.len() + 1) };
        // The END line runs to its closing dashes.
        let tail = start + end + END.len();
        let close = find(&rest[tail..], b"-----").map_or(rest.len(), |i| tail + i + 5);
        blocks.push(&rest[start..close]);
        rest = &rest[close..];
    }
    Ok(blocks)
}

/// A PEM block's verification key, checked now rather than at the first token: a private key is
/// refused (it verifies nothing here, and does not belong on an API host), and so is an EC key
/// ES256 cannot use (another curve than P-256). An RSA key is parsed at each verification: one
/// `from_rsa_pem` takes but cannot use (a mislabelled block, over 4096 bits) fails every token.
fn public_key(block: &[u8]) -> Result<(DecodingKey, Algorithm), &'static str> {
    let label = block.split(|b| *b == b'\n').next().unwrap_or_default();
    if label.windows(7).any(|w| w == b"PRIVATE") {
        return Err("is a private key: give the public key");
    }
    let (key, algorithm) = match (DecodingKey::from_rsa_pem(block), DecodingKey::from_ec_pem(block)) {
        (Ok(key), _) => (key, Algorithm::RS256),
        (_, Ok(key)) => (key, Algorithm::ES256),
        _ => return Err("is neither an RSA nor an EC public key"),
    };
    // A verifier is made for the key before any signature is read: Err means it cannot be.
    match jsonwebtoken::crypto::verify("AA", b"probe", &key, algorithm) {
        Ok(_) => Ok((key, algorithm)),
        Err(_) => Err("is a key RS256 or ES256 (P-256) cannot verify with"),
    }
}

/// The most roles of a token mnemo reads.
const MAX_TOKEN_ROLES: usize = 64;

/// The usable roles of a `roles` claim: a list's string entries that are valid labels, at most
/// [`MAX_TOKEN_ROLES`]; anything else (a string, a number, an odd entry) opens nothing.
fn token_roles(claim: &serde_json::Value) -> Vec<Label> {
    let Some(entries) = claim.as_array() else { return Vec::new() };
    let mut roles: Vec<Label> =
        entries.iter().filter_map(|e| e.as_str()).filter_map(|r| Label::parse("roles", r).ok()).collect();
    roles.sort();
    roles.dedup();
    roles.truncate(MAX_TOKEN_ROLES);
    roles
}

/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECONDS: u64 = 5;

impl Authenticator {
    /// With `audience` and `issuer`, a token must carry them as `aud` and `iss`.
    pub fn new(key: &JwtKey, audience: Option<&str>, issuer: Option<&str>) -> Result<Self, String> {
        let keys: Vec<(DecodingKey, Algorithm)> = match key {
            JwtKey::Hmac { secret, previous } => [Some(secret), previous.as_ref()]
                .into_iter()
                .flatten()
                .map(|secret| (DecodingKey::from_secret(secret.expose()), Algorithm::HS256))
                .collect(),
            JwtKey::PublicKeyPem { path, pem } => {
                let blocks =
                    pem_blocks(pem).map_err(|n| format!("{}: PEM block {n} has no END line", path.display()))?;
                if blocks.is_empty() {
                    return Err(format!("{} holds no PEM public key", path.display()));
                }
                let key = |(i, block): (usize, &[u8])| {
                    public_key(block).map_err(|why| format!("{}: PEM block {} {why}", path.display(), i + 1))
                };
                blocks.into_iter().enumerate().map(key).collect::<Result<_, _>>()?
            }
        };
        let keys = keys.into_iter().map(|(key, algorithm)| (key, validation(algorithm, audience, issuer))).collect();
        Ok(Self { keys })
    }

    /// The claims of a token that one of the keys signed: tried in order, the current first. A
    /// signature or an algorithm no key takes is refused as such; any other refusal (expired, not
    /// for this audience, …) comes from the key that verified the signature.
    pub fn verify(&self, token: &str) -> Result<Principal, ApiError> {
        let mut refused = ErrorKind::InvalidAlgorithm;
        for (key, validation) in &self.keys {
            match jsonwebtoken::decode::<Claims>(token, key, validation) {
                Ok(data) => return principal(data.claims),
                Err(e) if matches!(e.kind(), ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm) => {
                    // A bad signature says more than another key's algorithm.
                    if refused != ErrorKind::InvalidSignature {
                        refused = e.into_kind();
                    }
                }
                Err(e) => return Err(token_refused(e.kind())),
            }
        }
        Err(token_refused(&refused))
    }
}

/// The checks a token signed with `algorithm` passes.
fn validation(algorithm: Algorithm, audience: Option<&str>, issuer: Option<&str>) -> Validation {
    let mut validation = Validation::new(algorithm);
    let mut required = vec!["exp"];
    validation.leeway = LEEWAY_SECONDS;
    // jsonwebtoken ignores `nbf` unless asked: a token meant for later must not work now.
    validation.validate_nbf = true;
    validation.validate_aud = audience.is_some();
    if let Some(audience) = audience {
        validation.set_audience(&[audience]);
        required.push("aud");
    }
    if let Some(issuer) = issuer {
        validation.set_issuer(&[issuer]);
        required.push("iss");
    }
    validation.set_required_spec_claims(&required);
    validation
}

fn token_refused(kind: &ErrorKind) -> ApiError {
    match kind {
        ErrorKind::ExpiredSignature => ApiError::TokenExpired,
        ErrorKind::ImmatureSignature => ApiError::InvalidToken("not valid yet (nbf)".into()),
        ErrorKind::InvalidSignature => ApiError::InvalidToken("bad signature".into()),
        ErrorKind::MissingRequiredClaim(claim) => ApiError::InvalidToken(format!("missing claim {claim}")),
        ErrorKind::InvalidAlgorithm => ApiError::InvalidToken("wrong signing algorithm".into()),
        ErrorKind::InvalidAudience => ApiError::InvalidToken("not for this audience (aud)".into()),
        ErrorKind::InvalidIssuer => ApiError::InvalidToken("not from this issuer (iss)".into()),
        _ => ApiError::InvalidToken("malformed token".into()),
    }
}

/// The principal a verified token's claims name.
fn principal(claims: Claims) -> Result<Principal, ApiError> {
    let claim = |name: &str, e: mnemo_core::InvalidInput| ApiError::InvalidToken(format!("claim {name}: {e}"));
    let tenant = claims.tenant.as_deref().ok_or_else(|| ApiError::InvalidToken("missing claim tenant".into()))?;
    Ok(Principal {
        tenant: TenantId::parse(tenant).map_err(|e| claim("tenant", e))?,
        user: claims.sub.as_deref().map(UserId::parse).transpose().map_err(|e| claim("sub", e))?,
        agent: claims.agent.as_deref().map(AgentId::parse).transpose().map_err(|e| claim("agent", e))?,
        session: claims.sid.as_deref().map(SessionId::parse).transpose().map_err(|e| claim("sid", e))?,
        roles: token_roles(&claims.roles),
    })
}

/// Signs an HS256 token for development and tests (`mnemo-runbook token`).
pub fn sign_hs256(secret: &[u8], principal: &Principal, ttl: Duration) -> Result<String, String> {
    let exp = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|e| e.to_string())?.as_secs() + ttl.as_secs();
    sign_claims(secret, &claims_for(principal, exp))
}

pub fn claims_for(principal: &Principal, exp: u64) -> Claims {
    Claims {
        tenant: Some(principal.tenant.to_string()),
        sub: principal.user.as_ref().map(ToString::to_string),
        agent: principal.agent.as_ref().map(ToString::to_string),
        sid: principal.session.as_ref().map(ToString::to_string),
        roles: if principal.roles.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::Value::from(principal.roles.iter().map(|r| r.as_str()).collect::<Vec<_>>())
        },
        exp: exp.into(),
    }
}

pub fn sign_claims(secret: &[u8], claims: &Claims) -> Result<String, String> {
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &EncodingKey::from_secret(secret))
        .map_err(|e| e.to_string())
}

/// An authenticated caller, extracted from `Authorization: Bearer …`, charged one request of its
/// tenant's rate.
#[derive(Debug, Clone)]
pub struct Authenticated(pub Principal);

impl FromRequestParts<AppState> for Authenticated {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let Verified(principal) = Verified::from_request_parts(parts, state).await?;
        if parts.extensions.get::<Charged>().is_none() {
            charge(state, &principal)?;
        }
        Ok(Self(principal))
    }
}

/// Marks the request mnemo makes itself for an MCP tool call, whose charge `/mcp` took already.
/// Extensions never come from a client: nothing on the wire can set it.
#[derive(Debug, Clone, Copy)]
pub struct Charged;

/// Takes one request of the caller's tenant's rate, or refuses with the wait.
pub fn charge(state: &AppState, principal: &Principal) -> Result<(), ApiError> {
    match &state.rate_limit {
        Some(limiter) => limiter.check(&principal.tenant).map_err(ApiError::RateLimited),
        None => Ok(()),
    }
}

/// A caller whose token verifies, not charged: `/mcp`, which charges each message itself.
#[derive(Debug, Clone)]
pub struct Verified(pub Principal);

impl FromRequestParts<AppState> for Verified {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let header = parts.headers.get(AUTHORIZATION).ok_or(ApiError::MissingToken)?;
        let value = header.to_str().map_err(|_| ApiError::InvalidToken("unreadable Authorization header".into()))?;
        // The scheme's name is case-insensitive (RFC 9110 §11.1).
        let token = value
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or(ApiError::MissingToken)?;
        Ok(Self(state.auth.verify(token)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{}/../../tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).expect("fixture")
    }

    #[test]
    fn a_key_file_gives_public_keys_only_each_whole() {
        let both = [fixture("rs256-public.pem"), b"\r\n-- next --\r\n".to_vec(), fixture("es256-public.pem")].concat();
        let blocks = pem_blocks(&both).expect("whole blocks");
        let algorithms: Vec<_> = blocks.iter().map(|b| public_key(b).map(|(_, a)| a)).collect();
        assert_eq!(algorithms, [Ok(Algorithm::RS256), Ok(Algorithm::ES256)]);
        for private in ["rs256-private.pem", "es256-private.pem"] {
            assert!(public_key(&fixture(private)).is_err_and(|why| why.contains("private")), "{private}");
        }
        assert_eq!(pem_blocks(&both[..both.len() - 30]), Err(2), "the second key pasted in part");
    }
}
