//! A variant's dialect: which wire format its upstream speaks beyond the two client protocols,
//! and the keys that say where and as whom (`deployment`, `project`, `region`, credentials).
//!
//! `protocol` picks the dialect. `openai` and `anthropic` are the client protocols themselves;
//! `azure` and `openai-responses` ride on OpenAI Chat Completions, `gemini`, `vertex` and
//! `bedrock` on Anthropic Messages (the *hub*: see `keel_core::dialect`). The rest of the
//! gateway sees a variant as its hub protocol (`VariantConfig::protocol`); the dialect is applied
//! at the upstream edge (`upstream::cloud`).
//!
//! Credentials are read once, with the config: `${VAR}` in any of them, a service-account file
//! parsed and its key checked at load (a bad key is a config error, not a 401 at 3 a.m.), the
//! AWS environment variables when no keys are written. Nothing here is ever printed: `Debug`
//! redacts.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use keel_core::protocol::Protocol;

use super::read::{interpolate, Issues, Table, Val};

/// What a variant's upstream speaks.
#[derive(Clone, PartialEq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
    Azure(Azure),
    Gemini,
    Vertex(Vertex),
    Bedrock(Bedrock),
    OpenAiResponses,
}

/// The values `protocol` takes: the dialect's name and its hub protocol.
pub(super) const PROTOCOLS: [(&str, Kind); 7] = [
    ("openai", Kind::OpenAi),
    ("anthropic", Kind::Anthropic),
    ("azure", Kind::Azure),
    ("gemini", Kind::Gemini),
    ("vertex", Kind::Vertex),
    ("bedrock", Kind::Bedrock),
    ("openai-responses", Kind::OpenAiResponses),
];

/// A dialect before its keys are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    OpenAi,
    Anthropic,
    Azure,
    Gemini,
    Vertex,
    Bedrock,
    OpenAiResponses,
}

impl Kind {
    /// The protocol the rest of the gateway sees.
    pub(super) fn hub(self) -> Protocol {
        match self {
            Kind::OpenAi | Kind::Azure | Kind::OpenAiResponses => Protocol::OpenAi,
            Kind::Anthropic | Kind::Gemini | Kind::Vertex | Kind::Bedrock => Protocol::Anthropic,
        }
    }

    fn name(self) -> &'static str {
        PROTOCOLS
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("?", |(n, _)| n)
    }
}

/// Azure OpenAI.
#[derive(Clone, PartialEq)]
pub struct Azure {
    /// The classic path `/openai/deployments/{deployment}/chat/completions?api-version=…`;
    /// without one, the v1 path `/openai/v1/chat/completions` with the body's model.
    pub deployment: Option<String>,
    pub api_version: String,
    /// A Microsoft Entra ID token, sent as a bearer (instead of `api_key` as `api-key`).
    pub ad_token: Option<String>,
}

/// Vertex AI: Gemini models (`publishers/google`) or Claude (`publishers/anthropic`), chosen by
/// the model's name.
#[derive(Clone, PartialEq)]
pub struct Vertex {
    pub project: String,
    pub location: String,
    pub auth: VertexAuth,
}

#[derive(Clone, PartialEq)]
pub enum VertexAuth {
    /// A token obtained elsewhere (`gcloud auth print-access-token`), sent as is.
    AccessToken(String),
    /// A service account: keel signs its own grant and refreshes the token before it expires.
    ServiceAccount(Arc<ServiceAccount>),
}

/// The parts of a service-account key file the OAuth grant needs.
#[derive(PartialEq)]
pub struct ServiceAccount {
    pub client_email: String,
    /// PEM, checked at load as an RSA key jsonwebtoken can sign with.
    pub private_key: String,
    pub private_key_id: Option<String>,
    pub token_uri: String,
}

/// Bedrock (the Converse API).
#[derive(Clone, PartialEq)]
pub struct Bedrock {
    pub region: String,
    /// SigV4 keys; `None`: the variant's `api_key` is a Bedrock API key (a bearer).
    pub keys: Option<AwsKeys>,
}

#[derive(Clone, PartialEq)]
pub struct AwsKeys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl Dialect {
    /// Its name, as `protocol` spells it (metrics, traces and the access log use it too).
    pub fn name(&self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Anthropic => "anthropic",
            Dialect::Azure(_) => "azure",
            Dialect::Gemini => "gemini",
            Dialect::Vertex(_) => "vertex",
            Dialect::Bedrock(_) => "bedrock",
            Dialect::OpenAiResponses => "openai-responses",
        }
    }

    /// Whether the upstream speaks a client protocol itself (no edge translation).
    pub fn is_native(&self) -> bool {
        matches!(self, Dialect::OpenAi | Dialect::Anthropic)
    }
}

impl fmt::Debug for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the credentials: where the variant is, not as whom.
        match self {
            Dialect::Azure(a) => f
                .debug_struct("Azure")
                .field("deployment", &a.deployment)
                .field("api_version", &a.api_version)
                .finish_non_exhaustive(),
            Dialect::Vertex(v) => f
                .debug_struct("Vertex")
                .field("project", &v.project)
                .field("location", &v.location)
                .finish_non_exhaustive(),
            Dialect::Bedrock(b) => f
                .debug_struct("Bedrock")
                .field("region", &b.region)
                .finish_non_exhaustive(),
            other => f.write_str(other.name()),
        }
    }
}

/// The default `api_version` for Azure's classic deployment paths.
pub const AZURE_API_VERSION: &str = "2024-10-21";

/// Google's OAuth token endpoint, when a service-account file names none.
pub const GOOGLE_TOKEN_URI: &str = "https://oauth2.googleapis.com/token";

/// Every dialect key, with the dialect it belongs to: a key written for another dialect is an
/// error naming the one it is for (a Bedrock `region` on an Azure variant is a slip, not noise).
const KEYS: [(&str, Kind); 11] = [
    ("deployment", Kind::Azure),
    ("api_version", Kind::Azure),
    ("azure_ad_token", Kind::Azure),
    ("project", Kind::Vertex),
    ("location", Kind::Vertex),
    ("credentials_file", Kind::Vertex),
    ("access_token", Kind::Vertex),
    ("region", Kind::Bedrock),
    ("aws_access_key_id", Kind::Bedrock),
    ("aws_secret_access_key", Kind::Bedrock),
    ("aws_session_token", Kind::Bedrock),
];

/// Whether `upstream_model` may be left out (an Azure deployment names the model).
pub(super) fn model_optional(t: &mut Table, kind: Option<Kind>) -> bool {
    kind == Some(Kind::Azure) && t.raw("deployment").is_some()
}

/// Reads the dialect's keys. `api_key` is the variant's, already read.
pub(super) fn read(
    t: &mut Table,
    kind: Kind,
    api_key: Option<&str>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<Dialect> {
    for (key, owner) in KEYS {
        if owner != kind {
            if let Some(v) = t.get::<String>(key, issues) {
                issues.report(
                    v.at,
                    &v.path,
                    format!(
                        "applies to protocol = \"{}\" variants only (this one is \"{}\")",
                        owner.name(),
                        kind.name()
                    ),
                );
            }
        }
    }
    match kind {
        Kind::OpenAi => Some(Dialect::OpenAi),
        Kind::Anthropic => Some(Dialect::Anthropic),
        Kind::Gemini => Some(Dialect::Gemini),
        Kind::OpenAiResponses => Some(Dialect::OpenAiResponses),
        Kind::Azure => read_azure(t, api_key, env, issues),
        Kind::Vertex => read_vertex(t, env, issues),
        Kind::Bedrock => read_bedrock(t, api_key, env, issues),
    }
}

/// A string key, `${VAR}` replaced, that must not be empty: the value and where it was.
fn text(
    t: &mut Table,
    env: &HashMap<String, String>,
    key: &'static str,
    issues: &mut Issues,
) -> Option<(String, Val<String>)> {
    t.get::<String>(key, issues).and_then(|v| {
        let s = interpolate(&v, env, issues)?;
        if s.is_empty() {
            issues.report(v.at, &v.path, "must not be empty");
            return None;
        }
        Some((s, v))
    })
}

/// Azure OpenAI: the deployment (or the v1 API with `upstream_model`), the API version, and
/// the credential (`api_key` or an Entra ID token, not both).
fn read_azure(
    t: &mut Table,
    api_key: Option<&str>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<Dialect> {
    let deployment = text(t, env, "deployment", issues).map(|(s, _)| s);
    let api_version = text(t, env, "api_version", issues)
        .map(|(s, _)| s)
        .unwrap_or_else(|| AZURE_API_VERSION.to_owned());
    let ad_token = text(t, env, "azure_ad_token", issues);
    if let (Some((_, v)), Some(_)) = (&ad_token, api_key) {
        issues.report(
            v.at,
            &v.path,
            "set either api_key (sent as `api-key`) or azure_ad_token (a bearer), not both",
        );
    }
    Some(Dialect::Azure(Azure {
        deployment,
        api_version,
        ad_token: ad_token.map(|(s, _)| s),
    }))
}

/// Vertex AI: the project, the location, and a service-account key file or an access token.
fn read_vertex(
    t: &mut Table,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<Dialect> {
    let at = t.at();
    let path = t.field_path("project");
    let project = text(t, env, "project", issues);
    let location = text(t, env, "location", issues);
    let file = t.get::<String>("credentials_file", issues);
    let token = text(t, env, "access_token", issues);
    if project.is_none() {
        issues.report(at, &path, "missing; expected the Google Cloud project id");
    }
    if location.is_none() {
        issues.report(
            at,
            &path.replace("project", "location"),
            "missing; expected the region (e.g. \"us-east5\") or \"global\"",
        );
    }
    let auth = match (file, token) {
        (Some(f), None) => {
            service_account(&f, env, issues).map(|sa| VertexAuth::ServiceAccount(Arc::new(sa)))
        }
        (None, Some((tok, _))) => Some(VertexAuth::AccessToken(tok)),
        (Some(f), Some(_)) => {
            issues.report(
                f.at,
                &f.path,
                "set either credentials_file or access_token, not both",
            );
            None
        }
        (None, None) => {
            issues.report(
                at,
                &path.replace("project", "credentials_file"),
                "missing; expected a service-account key file (credentials_file) or access_token = \"${VAR}\"",
            );
            None
        }
    };
    Some(Dialect::Vertex(Vertex {
        project: project?.0,
        location: location?.0,
        auth: auth?,
    }))
}

/// Bedrock: the region, and SigV4 keys (written, or from the environment) unless a Bedrock API
/// key is the credential.
fn read_bedrock(
    t: &mut Table,
    api_key: Option<&str>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<Dialect> {
    let at = t.at();
    let path = t.field_path("region");
    let region = text(t, env, "region", issues)
        .map(|(s, _)| s)
        .or_else(|| env.get("AWS_REGION").filter(|s| !s.is_empty()).cloned());
    let id = text(t, env, "aws_access_key_id", issues);
    let secret = text(t, env, "aws_secret_access_key", issues);
    let session = text(t, env, "aws_session_token", issues).map(|(s, _)| s);
    if region.is_none() {
        issues.report(
            at,
            &path,
            "missing; expected the AWS region (e.g. \"us-east-1\")",
        );
    }
    let keys = match (id, secret) {
        (Some((id, _)), Some((secret, _))) => Some(AwsKeys {
            access_key_id: id,
            secret_access_key: secret,
            session_token: session,
        }),
        (Some((_, v)), None) | (None, Some((_, v))) => {
            issues.report(
                v.at,
                &v.path,
                "aws_access_key_id and aws_secret_access_key go together",
            );
            return None;
        }
        (None, None) if api_key.is_some() => None,
        (None, None) => {
            let get = |k: &str| env.get(k).filter(|s| !s.is_empty()).cloned();
            match (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY")) {
                (Some(id), Some(secret)) => Some(AwsKeys {
                    access_key_id: id,
                    secret_access_key: secret,
                    session_token: session.or_else(|| get("AWS_SESSION_TOKEN")),
                }),
                _ => {
                    issues.report(
                        at,
                        &path.replace("region", "aws_access_key_id"),
                        "missing; expected aws_access_key_id + aws_secret_access_key, the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables, or a Bedrock API key in api_key",
                    );
                    return None;
                }
            }
        }
    };
    Some(Dialect::Bedrock(Bedrock {
        region: region?,
        keys,
    }))
}

/// A service-account key file: read, parsed, its key checked.
fn service_account(
    f: &Val<String>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<ServiceAccount> {
    let file = interpolate(f, env, issues)?;
    let mut fail = |why: String| {
        issues.report(f.at, &f.path, format!("{file}: {why}"));
        None
    };
    let text = match std::fs::read_to_string(&file) {
        Ok(t) => t,
        Err(e) => return fail(format!("cannot read: {e}")),
    };
    let v: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => return fail(format!("not a service-account key file (JSON): {e}")),
    };
    let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    if field("type").as_deref() != Some("service_account") {
        return fail("expected \"type\": \"service_account\" (a service-account key file)".into());
    }
    let (Some(client_email), Some(private_key)) = (field("client_email"), field("private_key"))
    else {
        return fail("missing client_email or private_key".into());
    };
    if jsonwebtoken::EncodingKey::from_rsa_pem(private_key.as_bytes()).is_err() {
        return fail("private_key is not an RSA private key in PEM".into());
    }
    let token_uri = field("token_uri").unwrap_or_else(|| GOOGLE_TOKEN_URI.to_owned());
    if !(token_uri.starts_with("https://") || token_uri.starts_with("http://")) {
        return fail(format!(
            "token_uri must be an http(s) URL, got {token_uri:?}"
        ));
    }
    Some(ServiceAccount {
        client_email,
        private_key,
        private_key_id: field("private_key_id"),
        token_uri,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn parse(variant: &str, env: &[(&str, &str)]) -> Result<Config, String> {
        let text =
            format!("[[pools]]\nname = \"m\"\n[[pools.variants]]\nname = \"v\"\n{variant}\n");
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::parse(&text, "t.toml", &env).map_err(|e| e.to_string())
    }

    fn dialect(variant: &str, env: &[(&str, &str)]) -> (Protocol, Dialect) {
        let c = parse(variant, env).unwrap();
        let v = &c.pools[0].variants[0];
        (v.protocol, v.dialect.clone())
    }

    #[test]
    fn each_dialect_rides_on_its_hub() {
        let (p, d) = dialect(
            "protocol = \"azure\"\nurl = \"https://r.openai.azure.com\"\ndeployment = \"gpt4o\"\napi_key = \"k\"",
            &[],
        );
        assert_eq!(p, Protocol::OpenAi);
        let Dialect::Azure(a) = d else {
            panic!("{d:?}")
        };
        assert_eq!(a.deployment.as_deref(), Some("gpt4o"));
        assert_eq!(a.api_version, AZURE_API_VERSION);
        let c = parse(
            "protocol = \"azure\"\nurl = \"https://r.openai.azure.com\"\ndeployment = \"gpt4o\"",
            &[],
        )
        .unwrap();
        assert_eq!(
            c.pools[0].variants[0].upstream_model, "gpt4o",
            "a deployment names the model"
        );
        let (p, d) = dialect(
            "protocol = \"gemini\"\nurl = \"https://generativelanguage.googleapis.com\"\nupstream_model = \"gemini-2.5-flash\"\napi_key = \"${K}\"",
            &[("K", "g")],
        );
        assert_eq!((p, d), (Protocol::Anthropic, Dialect::Gemini));
        let (p, d) = dialect(
            "protocol = \"bedrock\"\nurl = \"https://bedrock-runtime.us-east-1.amazonaws.com\"\nupstream_model = \"anthropic.claude-3-5-haiku-20241022-v1:0\"\nregion = \"us-east-1\"",
            &[("AWS_ACCESS_KEY_ID", "AKID"), ("AWS_SECRET_ACCESS_KEY", "S"), ("AWS_SESSION_TOKEN", "T")],
        );
        assert_eq!(p, Protocol::Anthropic);
        let Dialect::Bedrock(b) = d else {
            panic!("{d:?}")
        };
        let keys = b.keys.unwrap();
        assert_eq!(
            (keys.access_key_id.as_str(), keys.session_token.as_deref()),
            ("AKID", Some("T")),
            "the standard AWS environment variables"
        );
        let (p, d) = dialect(
            "protocol = \"openai-responses\"\nurl = \"https://api.openai.com/v1\"\nupstream_model = \"o3\"",
            &[],
        );
        assert_eq!((p, d), (Protocol::OpenAi, Dialect::OpenAiResponses));
    }

    #[test]
    fn a_service_account_file_is_read_and_its_key_checked() {
        let file = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/service-account.json"
        );
        let (p, d) = dialect(
            &format!("protocol = \"vertex\"\nurl = \"https://us-east5-aiplatform.googleapis.com\"\nupstream_model = \"claude-sonnet-4@20250514\"\nproject = \"p\"\nlocation = \"us-east5\"\ncredentials_file = \"{file}\""),
            &[],
        );
        assert_eq!(p, Protocol::Anthropic);
        let Dialect::Vertex(v) = d else {
            panic!("{d:?}")
        };
        let VertexAuth::ServiceAccount(sa) = v.auth else {
            panic!("an access token")
        };
        assert_eq!(
            sa.client_email,
            "keel-test@keel-test.iam.gserviceaccount.com"
        );
        assert!(grant_is_signed(&sa));

        let bad = std::env::temp_dir().join(format!("keel-bad-sa-{}.json", std::process::id()));
        std::fs::write(
            &bad,
            r#"{"type":"service_account","client_email":"a@b","private_key":"not a key"}"#,
        )
        .unwrap();
        let e = parse(
            &format!("protocol = \"vertex\"\nurl = \"https://x\"\nupstream_model = \"gemini-2.5-pro\"\nproject = \"p\"\nlocation = \"global\"\ncredentials_file = \"{}\"", bad.display()),
            &[],
        )
        .unwrap_err();
        std::fs::remove_file(&bad).ok();
        assert!(e.contains("private_key is not an RSA private key"), "{e}");
        assert!(
            !e.contains("not a key"),
            "the key itself is never printed: {e}"
        );
    }

    fn grant_is_signed(sa: &ServiceAccount) -> bool {
        jsonwebtoken::EncodingKey::from_rsa_pem(sa.private_key.as_bytes()).is_ok()
    }

    #[test]
    fn a_key_of_another_dialect_or_a_missing_one_is_named() {
        let e = parse(
            "protocol = \"azure\"\nurl = \"https://r.openai.azure.com\"\nupstream_model = \"m\"\nregion = \"us-east-1\"",
            &[],
        )
        .unwrap_err();
        assert!(
            e.contains("region") && e.contains("applies to protocol = \"bedrock\" variants only"),
            "{e}"
        );
        let e = parse(
            "protocol = \"bedrock\"\nurl = \"https://b\"\nupstream_model = \"m\"\nregion = \"us-east-1\"",
            &[],
        )
        .unwrap_err();
        assert!(e.contains("aws_access_key_id"), "{e}");
        let e = parse(
            "protocol = \"vertex\"\nurl = \"https://v\"\nupstream_model = \"m\"",
            &[],
        )
        .unwrap_err();
        assert!(
            e.contains("project") && e.contains("location") && e.contains("credentials_file"),
            "{e}"
        );
        let e = parse("protocol = \"gemini\"\nurl = \"https://g\"", &[]).unwrap_err();
        assert!(e.contains("upstream_model"), "{e}");
    }

    #[test]
    fn debug_never_prints_credentials() {
        let (_, d) = dialect(
            "protocol = \"bedrock\"\nurl = \"https://b\"\nupstream_model = \"m\"\nregion = \"eu-west-1\"\naws_access_key_id = \"AKIDSECRETID\"\naws_secret_access_key = \"VERYSECRET\"",
            &[],
        );
        let printed = format!("{d:?}");
        assert!(
            printed.contains("eu-west-1") && !printed.contains("SECRET"),
            "{printed}"
        );
    }

    /// The book's example of every cloud (docs/src/providers.md) is a config keel reads.
    #[test]
    fn the_book_example_parses() {
        let chapter = include_str!("../../../../docs/src/providers.md");
        let at = chapter
            .find("**Every cloud")
            .expect("the Providers chapter's cloud section");
        let block = &chapter[at..];
        let start = block.find("```toml\n").unwrap() + 8;
        let end = start + block[start..].find("```").unwrap();
        let file = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/service-account.json"
        );
        let text = block[start..end].replace("/etc/keel/vertex-sa.json", file);
        let env: HashMap<String, String> = [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AZURE_OPENAI_API_KEY",
            "OPENAI_API_KEY",
            "GEMINI_API_KEY",
        ]
        .iter()
        .map(|k| (k.to_string(), "x".to_string()))
        .collect();
        let c = Config::parse(&text, "providers.md", &env).unwrap();
        let names: Vec<&str> = c
            .pools
            .iter()
            .flat_map(|p| p.variants.iter().map(|v| v.dialect.name()))
            .collect();
        assert_eq!(
            names,
            ["bedrock", "vertex", "azure", "openai-responses", "gemini"]
        );
    }

    #[test]
    fn a_cloud_variant_forwards_only_trace_context_by_default() {
        let c = parse(
            "protocol = \"bedrock\"\nurl = \"https://b\"\nupstream_model = \"m\"\nregion = \"us-east-1\"\napi_key = \"k\"",
            &[],
        )
        .unwrap();
        let names: Vec<&str> = c.pools[0].variants[0]
            .forward_headers
            .iter()
            .map(|h| h.as_str())
            .collect();
        assert!(names.contains(&"traceparent"), "{names:?}");
        assert!(
            !names.iter().any(|n| n.starts_with("anthropic-")),
            "Anthropic's headers mean nothing to Bedrock: {names:?}"
        );
    }
}
