//! Token rules beyond the table in bad_input.rs: public-key verification (RS256, ES256), unsigned
//! tokens (`alg: none`) and algorithm confusion.

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use mnemo_api::auth::claims_for;
use mnemo_testkit::{TestApp, principal, token};
use serde_json::json;

fn fixture(name: &str) -> String {
    format!("{}/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn exp() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() + 600
}

async fn accepts_public_key_tokens(algorithm: Algorithm, private: &str, public: &str) {
    let app = TestApp::spawn_with(&[("MNEMO_JWT_SECRET", ""), ("MNEMO_JWT_PUBLIC_KEY_FILE", &fixture(public))]).await;
    let pem = std::fs::read(fixture(private)).expect("fixture");
    let key = match algorithm {
        Algorithm::RS256 => EncodingKey::from_rsa_pem(&pem),
        _ => EncodingKey::from_ec_pem(&pem),
    }
    .expect("private key");
    let claims = claims_for(&principal("acme", Some("u1"), None, None), exp());
    let signed = jsonwebtoken::encode(&Header::new(algorithm), &claims, &key).expect("sign");
    let fact = json!({ "content": "prefers dark mode", "scope": "user" });

    let reply = app.client.post("/v1/facts", Some(&signed), &fact).await;
    assert_eq!(reply.status, 201, "{algorithm:?}: {:?}", reply.body);

    // An HS256 token (signed with the test secret the server does not use here) is refused.
    let hs = app.client.post("/v1/facts", Some(&token(&principal("acme", Some("u1"), None, None))), &fact).await;
    assert_eq!((hs.status, hs.code()), (401, "invalid_token"));
}

#[tokio::test]
async fn rs256_tokens_verify_with_the_public_key() {
    accepts_public_key_tokens(Algorithm::RS256, "rs256-private.pem", "rs256-public.pem").await;
}

#[tokio::test]
async fn es256_tokens_verify_with_the_public_key() {
    accepts_public_key_tokens(Algorithm::ES256, "es256-private.pem", "es256-public.pem").await;
}

/// `{"alg":"none","typ":"JWT"}`, base64url: the header of an unsigned token.
const ALG_NONE_HEADER: &str = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0";

/// A token's header swapped for `alg: none`, once without a signature and once keeping it.
fn unsigned(token: &str) -> [String; 2] {
    let mut parts = token.split('.');
    let (_, claims, signature) = (parts.next(), parts.next().expect("claims"), parts.next().expect("signature"));
    [format!("{ALG_NONE_HEADER}.{claims}."), format!("{ALG_NONE_HEADER}.{claims}.{signature}")]
}

#[tokio::test]
async fn unsigned_tokens_and_algorithm_confusion_are_refused() {
    let fact = json!({ "content": "prefers dark mode", "scope": "user" });
    let claims = claims_for(&principal("acme", Some("u1"), None, None), exp());

    // A server with a shared secret: `alg: none`, and an RS256 token (its own key pair).
    let hmac = TestApp::spawn().await;
    let good = token(&principal("acme", Some("u1"), None, None));
    let rsa = EncodingKey::from_rsa_pem(&std::fs::read(fixture("rs256-private.pem")).expect("fixture")).expect("key");
    let rs256 = jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims, &rsa).expect("sign");
    let [bare, kept] = unsigned(&good);
    for (name, forged) in [("alg none", bare), ("alg none, signature kept", kept), ("RS256 to an HS256 server", rs256)]
    {
        let reply = hmac.client.post("/v1/facts", Some(&forged), &fact).await;
        assert_eq!((reply.status, reply.code()), (401, "invalid_token"), "{name}");
    }

    // A server with a public key: `alg: none`, and the classic confusion, an HS256 token whose
    // secret is the public key itself.
    let public = fixture("rs256-public.pem");
    let keyed = TestApp::spawn_with(&[("MNEMO_JWT_SECRET", ""), ("MNEMO_JWT_PUBLIC_KEY_FILE", &public)]).await;
    let confused = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(&std::fs::read(&public).expect("fixture")),
    )
    .expect("sign");
    let rs256 = jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims, &rsa).expect("sign");
    let [bare, kept] = unsigned(&rs256);
    for (name, forged) in
        [("alg none", bare), ("alg none, signature kept", kept), ("HS256 keyed with the public key", confused)]
    {
        let reply = keyed.client.post("/v1/facts", Some(&forged), &fact).await;
        assert_eq!((reply.status, reply.code()), (401, "invalid_token"), "{name}");
    }
    // The genuine token still goes in, so the refusals above are the forgeries'.
    assert_eq!(keyed.client.post("/v1/facts", Some(&rs256), &fact).await.status, 201);
    for (app, expected) in [(&hmac, 0), (&keyed, 1)] {
        let rows: i64 =
            sqlx::query_scalar("SELECT count(*) FROM memory_items").fetch_one(&app.db.pool).await.expect("count");
        assert_eq!(rows, expected, "a forged token wrote a row");
    }
}

/// With MNEMO_JWT_AUDIENCE and MNEMO_JWT_ISSUER, a token signed with the right key opens nothing
/// unless it names this audience and issuer: an identity provider's key also signs tokens for
/// other applications.
#[tokio::test]
async fn a_configured_audience_and_issuer_are_required() {
    let secret = "a-secret-of-at-least-thirty-two-bytes!";
    let app = TestApp::spawn_with(&[
        ("MNEMO_JWT_SECRET", secret),
        ("MNEMO_JWT_AUDIENCE", "mnemo"),
        ("MNEMO_JWT_ISSUER", "https://id.example"),
    ])
    .await;
    let sign = |extra: serde_json::Value| {
        let mut claims =
            serde_json::to_value(claims_for(&principal("acme", Some("u1"), None, None), exp())).expect("claims");
        claims.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret.as_bytes()))
            .expect("sign")
    };
    let fact = json!({ "content": "prefers dark mode", "scope": "user" });
    for (claims, expected) in [
        (json!({ "aud": "mnemo", "iss": "https://id.example" }), 201),
        (json!({ "aud": ["billing", "mnemo"], "iss": "https://id.example" }), 201),
        (json!({ "aud": "billing", "iss": "https://id.example" }), 401),
        (json!({ "aud": "mnemo", "iss": "https://other.example" }), 401),
        (json!({ "iss": "https://id.example" }), 401),
        (json!({ "aud": "mnemo" }), 401),
    ] {
        let reply = app.client.post("/v1/facts", Some(&sign(claims.clone())), &fact).await;
        let status = if reply.status == 200 { 201 } else { reply.status };
        assert_eq!(status, expected, "{claims}: {:?}", reply.body);
    }
}

/// The scheme's name is read whatever its case (RFC 9110), and a 401 names the scheme to use
/// (`WWW-Authenticate: Bearer`, RFC 6750), as MCP clients look for it.
#[tokio::test]
async fn the_bearer_scheme_is_read_in_any_case_and_a_401_names_it() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), None, Some("s1")));
    let http = reqwest::Client::new();
    let messages = format!("{}/v1/sessions/s1/messages", app.client.base);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let reply = http.get(&messages).header("authorization", format!("{scheme} {t}")).send().await.expect("sent");
        assert_eq!(reply.status(), 200, "{scheme}");
    }
    for authorization in [None, Some(format!("Basic {t}")), Some("Bearer".to_owned())] {
        let mut request = http.get(&messages);
        if let Some(value) = &authorization {
            request = request.header("authorization", value);
        }
        let reply = request.send().await.expect("sent");
        assert_eq!(reply.status(), 401, "{authorization:?}");
        assert_eq!(reply.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
    }
}

/// A secret rotated out keeps verifying the tokens it signed while `MNEMO_JWT_PREVIOUS_SECRET`
/// names it; the new secret's tokens verify too, and any other secret's do not.
#[tokio::test]
async fn a_secret_being_rotated_out_still_verifies_its_tokens() {
    let fact = json!({ "content": "prefers dark mode", "scope": "user" });
    let claims = claims_for(&principal("acme", Some("u1"), None, None), exp());
    let signed = |secret: &str| {
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret.as_bytes()))
            .expect("sign")
    };
    let new_secret = "a-new-secret-of-at-least-32-bytes-0123456789";
    let rotating = TestApp::spawn_with(&[
        ("MNEMO_JWT_SECRET", new_secret),
        ("MNEMO_JWT_PREVIOUS_SECRET", mnemo_testkit::TEST_JWT_SECRET),
    ])
    .await;
    let old = token(&principal("acme", Some("u1"), None, None));
    for (name, t) in [("the previous secret's", old.clone()), ("the new secret's", signed(new_secret))] {
        let reply = rotating.client.post("/v1/facts", Some(&t), &fact).await;
        assert!(reply.status < 300, "{name}: {:?}", reply.body);
    }
    let other = signed("some-other-secret-of-at-least-32-bytes-xx");
    let reply = rotating.client.post("/v1/facts", Some(&other), &fact).await;
    assert_eq!((reply.status, reply.code()), (401, "invalid_token"));
    assert_eq!(
        reply.body["error"]["message"].as_str().map(|m| m.contains("bad signature")),
        Some(true),
        "{:?}",
        reply.body
    );

    let rotated = TestApp::spawn_with(&[("MNEMO_JWT_SECRET", new_secret)]).await;
    let reply = rotated.client.post("/v1/facts", Some(&old), &fact).await;
    assert_eq!((reply.status, reply.code()), (401, "invalid_token"), "the rotated-out secret once unset");
}

/// A public key file may hold several keys (an identity provider's current and next, of either
/// algorithm): a token any of them signed verifies.
#[tokio::test]
async fn a_public_key_file_with_several_keys_verifies_each_ones_tokens() {
    let bundle = std::env::temp_dir().join(format!("mnemo-keys-{}.pem", uuid::Uuid::new_v4().simple()));
    let pems: Vec<u8> = ["rs256-public.pem", "es256-public.pem"]
        .iter()
        .flat_map(|name| std::fs::read(fixture(name)).expect("fixture"))
        .collect();
    std::fs::write(&bundle, pems).expect("bundle");
    let app =
        TestApp::spawn_with(&[("MNEMO_JWT_SECRET", ""), ("MNEMO_JWT_PUBLIC_KEY_FILE", bundle.to_str().expect("path"))])
            .await;
    let _ = std::fs::remove_file(&bundle);
    let claims = claims_for(&principal("acme", Some("u1"), None, None), exp());
    let fact = json!({ "content": "prefers dark mode", "scope": "user" });
    for (algorithm, private) in [(Algorithm::RS256, "rs256-private.pem"), (Algorithm::ES256, "es256-private.pem")] {
        let pem = std::fs::read(fixture(private)).expect("fixture");
        let key = match algorithm {
            Algorithm::RS256 => EncodingKey::from_rsa_pem(&pem),
            _ => EncodingKey::from_ec_pem(&pem),
        }
        .expect("private key");
        let signed = jsonwebtoken::encode(&Header::new(algorithm), &claims, &key).expect("sign");
        let reply = app.client.post("/v1/facts", Some(&signed), &fact).await;
        assert!(reply.status < 300, "{algorithm:?}: {:?}", reply.body);
    }
    let hs = app.client.post("/v1/facts", Some(&token(&principal("acme", Some("u1"), None, None))), &fact).await;
    assert_eq!((hs.status, hs.code()), (401, "invalid_token"));
    assert_eq!(hs.body["error"]["message"].as_str().map(|m| m.contains("algorithm")), Some(true), "{:?}", hs.body);
}
