//! Token rules beyond the table in bad_input.rs: public-key verification (RS256, ES256) and
//! algorithm confusion.

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
