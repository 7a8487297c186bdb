//! Vertex AI: Claude at `…/publishers/anthropic/models/{model}:rawPredict` /
//! `:streamRawPredict` (Anthropic Messages bodies without `model`, with `anthropic_version` in
//! the body), and the OAuth token endpoint (`POST /token`) a service account's JWT grant
//! (RFC 7523) is made against, whose tokens the Vertex routes accept as bearers.

use base64::Engine;
use serde_json::{json, Map, Value};

use super::{HubRequest, Route};

pub fn claude_to_hub(route: &Route, obj: &Map<String, Value>) -> Result<HubRequest, String> {
    if !obj.contains_key("anthropic_version") {
        return Err("anthropic_version: Field required".into());
    }
    if obj.contains_key("model") {
        return Err("model: Extra inputs are not permitted".into());
    }
    let mut hub = obj.clone();
    hub.remove("anthropic_version");
    hub.insert(
        "model".into(),
        json!(route.model.as_deref().unwrap_or_default()),
    );
    if route.stream {
        hub.insert("stream".into(), json!(true));
    }
    Ok(HubRequest {
        body: Value::Object(hub),
        schema: None,
    })
}

/// Google's token endpoint: the audience Google's own libraries (google-auth) put in every
/// grant, whatever the account's `token_uri`; accepted beside this endpoint's own URL.
pub const GOOGLE_TOKEN_URL: &str = "https://oauth2.googleapis.com/token";

/// The JWT-bearer grant type.
pub const JWT_BEARER: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";

/// Checks a token request (a form body) as Google's token endpoint does: the grant type, and a
/// JWT assertion whose header says RS256 and whose claims carry `iss`, `scope` (or
/// `target_audience`), `aud` = this endpoint's URL (`token_url`) or Google's, and `iat`/`exp` an hour or
/// less apart around `now_s`. The signature is not verified (the simulator does not hold the
/// account's public key). `Err`: the OAuth error (`error`, `error_description`).
pub fn check_grant(form: &str, token_url: &str, now_s: u64) -> Result<(), (String, String)> {
    let bad = |e: &str, d: String| Err((e.to_owned(), d));
    let grant = super::query_param(form, "grant_type").unwrap_or_default();
    if grant != JWT_BEARER {
        return bad(
            "unsupported_grant_type",
            format!("Invalid grant_type: {grant}"),
        );
    }
    let Some(assertion) = super::query_param(form, "assertion") else {
        return bad(
            "invalid_request",
            "Missing required parameter: assertion".into(),
        );
    };
    let segments: Vec<&str> = assertion.split('.').collect();
    let [header, claims, signature] = segments[..] else {
        return bad("invalid_grant", "Invalid JWT: not three segments".into());
    };
    let decode = |s: &str| -> Option<Value> {
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s.trim_end_matches('='))
            .ok()?;
        serde_json::from_slice(&bytes).ok()
    };
    let (Some(header), Some(claims)) = (decode(header), decode(claims)) else {
        return bad(
            "invalid_grant",
            "Invalid JWT: a segment is not base64url JSON".into(),
        );
    };
    if signature.is_empty() {
        return bad("invalid_grant", "Invalid JWT Signature.".into());
    }
    if header.get("alg").and_then(Value::as_str) != Some("RS256") {
        return bad("invalid_grant", "Invalid JWT: alg must be RS256".into());
    }
    let claim = |k: &str| {
        claims
            .get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    if claim("iss").is_none() {
        return bad("invalid_grant", "Invalid JWT: missing iss".into());
    }
    if claim("scope").is_none() && claim("target_audience").is_none() {
        return bad("invalid_scope", "Invalid JWT: missing scope".into());
    }
    if claim("aud") != Some(token_url) && claim("aud") != Some(GOOGLE_TOKEN_URL) {
        return bad(
            "invalid_grant",
            format!(
                "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. aud must be {token_url} or {GOOGLE_TOKEN_URL}, got {}",
                claims.get("aud").unwrap_or(&Value::Null)
            ),
        );
    }
    let (Some(iat), Some(exp)) = (
        claims.get("iat").and_then(Value::as_u64),
        claims.get("exp").and_then(Value::as_u64),
    ) else {
        return bad(
            "invalid_grant",
            "Invalid JWT: iat and exp are required".into(),
        );
    };
    // Google allows a little clock skew either way.
    let skew = 300;
    if exp <= iat || exp - iat > 3600 || iat > now_s + skew || exp + skew < now_s {
        return bad(
            "invalid_grant",
            "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. Check your iat and exp values in the JWT claim.".into(),
        );
    }
    Ok(())
}

/// The token answer.
pub fn token_body(token: &str) -> Value {
    json!({"access_token": token, "expires_in": 3600, "token_type": "Bearer"})
}
