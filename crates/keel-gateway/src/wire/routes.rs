//! The route table: every method and path keel serves, in one list that both the router
//! (`server::route`) and the OpenAPI document (`openapi`) read, so that a route cannot be served
//! without being documented, nor documented without being served.

use keel_core::protocol::Endpoint;

/// The HTTP methods keel serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Get,
    Post,
}

impl Verb {
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "GET",
            Verb::Post => "POST",
        }
    }

    fn of(method: &http::Method) -> Option<Verb> {
        match *method {
            http::Method::GET => Some(Verb::Get),
            http::Method::POST => Some(Verb::Post),
            _ => None,
        }
    }
}

/// What keel does for a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A generation (or token-count, or embeddings) request, relayed to a pool.
    Generation(ClientApi),
    /// `GET /v1/models`.
    Models,
    /// `GET /v1/models/{model_id}`.
    Model,
    Health,
    /// `GET /keel/decisions` (filtered, newest first).
    Decisions,
    /// `GET /keel/decisions/{request_id}`.
    Decision,
    /// Prometheus metrics (served at two paths).
    Metrics,
    OpenApi,
    /// `GET /keel/keys/{key_id}/usage` (admin key required).
    KeyUsage,
    /// `POST /keel/admin/safe-mode` (admin key required when keys are configured).
    SafeMode,
    /// `GET /keel/shadow/{pool}`: shadow comparisons.
    Shadow,
    /// `POST /keel/admin/canary/{pool}/promote` (admin key required when keys are configured).
    CanaryPromote,
    /// `POST /keel/admin/canary/{pool}/rollback` (admin key required when keys are configured).
    CanaryRollback,

    /// `POST /keel/admin/reload`: re-read the config file (admin key as for safe mode).
    Reload,
    /// `GET /keel/ready`: readiness (503 while draining).
    Ready,
    /// `GET /keel/live`: liveness.
    Live,
    /// The dashboard's snapshot stream (server-sent events).
    Events,
    /// The dashboard page.
    Dashboard,
    /// `GET /keel/analyze`: workload analysis of the recent fingerprinted requests.
    Analyze,
}

/// Who may use a route. The server checks it once, before the route's handler runs
/// (`server::route`), so a handler never answers an outsider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone who reaches the port: liveness and readiness, which load balancers and kubelets
    /// ask without a key and which say nothing about tenants or the fleet's members; and the
    /// dashboard's page, which holds no data (it asks for the admin key and reads
    /// `/keel/events` with it).
    Anyone,
    /// A tenant: any configured key (checked by admission and the models handlers, which also
    /// need to know which key it is); anyone when keel runs open.
    Tenant,
    /// The operations plane's reads (every tenant's traffic, keys' usage, the fleet): the admin
    /// key or a key with the `ops` role, whenever keys or an admin key are configured.
    Ops,
    /// Changes to the running gateway: the admin key whenever keys or an admin key are
    /// configured; with neither, a JSON request from no foreign web origin (so that a page
    /// open in a developer's browser cannot post to a keel on localhost).
    Admin,
}

/// Which listener serves a route when `admin_listen` gives the operations plane its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// `/v1/*`: the main listener only.
    Data,
    /// `/keel/*` and `/metrics`: the admin listener only (when there is one).
    Ops,
    /// Liveness and readiness: both, so probes work whichever port they are pointed at.
    Both,
}

/// One served route. A path ending in `{model_id}` matches any non-empty remainder (a model id
/// may hold `/`); a parameter inside a path (`{key_id}`) matches one non-empty segment.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub verb: Verb,
    pub path: &'static str,
    pub target: Target,
}

const fn route(verb: Verb, path: &'static str, target: Target) -> Route {
    Route { verb, path, target }
}

impl Target {
    /// Who may use the route.
    pub fn access(self) -> Access {
        match self {
            Target::Generation(_) | Target::Models | Target::Model => Access::Tenant,
            Target::Ready | Target::Live | Target::Dashboard => Access::Anyone,
            Target::SafeMode | Target::CanaryPromote | Target::CanaryRollback | Target::Reload => {
                Access::Admin
            }
            Target::Health
            | Target::Decisions
            | Target::Decision
            | Target::Metrics
            | Target::OpenApi
            | Target::KeyUsage
            | Target::Shadow
            | Target::Analyze
            | Target::Events => Access::Ops,
        }
    }

    /// Which listener serves the route.
    pub fn plane(self) -> Plane {
        match self {
            Target::Generation(_) | Target::Models | Target::Model => Plane::Data,
            Target::Ready | Target::Live => Plane::Both,
            _ => Plane::Ops,
        }
    }
}

/// Every route keel serves, in the order the OpenAPI document lists them.
pub const ROUTES: &[Route] = &[
    route(
        Verb::Post,
        "/v1/chat/completions",
        Target::Generation(ClientApi::Endpoint(Endpoint::ChatCompletions)),
    ),
    route(
        Verb::Post,
        "/v1/completions",
        Target::Generation(ClientApi::Endpoint(Endpoint::Completions)),
    ),
    route(
        Verb::Post,
        "/v1/messages",
        Target::Generation(ClientApi::Endpoint(Endpoint::Messages)),
    ),
    route(
        Verb::Post,
        "/v1/messages/count_tokens",
        Target::Generation(ClientApi::Endpoint(Endpoint::CountTokens)),
    ),
    route(
        Verb::Post,
        "/v1/responses",
        Target::Generation(ClientApi::Responses),
    ),
    route(
        Verb::Post,
        "/v1/embeddings",
        Target::Generation(ClientApi::Endpoint(Endpoint::Embeddings)),
    ),
    route(Verb::Get, "/v1/models", Target::Models),
    route(Verb::Get, "/v1/models/{model_id}", Target::Model),
    route(Verb::Get, "/keel/health", Target::Health),
    route(Verb::Get, "/keel/decisions", Target::Decisions),
    route(Verb::Get, "/keel/decisions/{request_id}", Target::Decision),
    route(Verb::Get, "/metrics", Target::Metrics),
    route(Verb::Get, "/keel/metrics", Target::Metrics),
    route(Verb::Get, "/keel/openapi.json", Target::OpenApi),
    route(Verb::Get, "/keel/keys/{key_id}/usage", Target::KeyUsage),
    route(Verb::Post, "/keel/admin/safe-mode", Target::SafeMode),
    route(Verb::Get, "/keel/shadow/{pool}", Target::Shadow),
    route(
        Verb::Post,
        "/keel/admin/canary/{pool}/promote",
        Target::CanaryPromote,
    ),
    route(
        Verb::Post,
        "/keel/admin/canary/{pool}/rollback",
        Target::CanaryRollback,
    ),
    route(Verb::Post, "/keel/admin/reload", Target::Reload),
    route(Verb::Get, "/keel/ready", Target::Ready),
    route(Verb::Get, "/keel/live", Target::Live),
    route(Verb::Get, "/keel/events", Target::Events),
    route(Verb::Get, "/keel/dashboard", Target::Dashboard),
    route(Verb::Get, "/keel/analyze", Target::Analyze),
];

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved<'a> {
    /// A served route; `param` is the `{…}` part of the path, if the route has one.
    Route(Target, Option<&'a str>),
    /// The path is served, but not with this method (405).
    MethodNotAllowed,
    NotFound,
}

/// The route for a request's method and path.
pub fn resolve<'a>(method: &http::Method, path: &'a str) -> Resolved<'a> {
    let verb = Verb::of(method);
    let mut path_known = false;
    for r in ROUTES {
        let Some(param) = matches(r.path, path) else {
            continue;
        };
        if Some(r.verb) == verb {
            return Resolved::Route(r.target, param);
        }
        path_known = true;
    }
    if path_known {
        Resolved::MethodNotAllowed
    } else {
        Resolved::NotFound
    }
}

/// Whether `path` matches the route `template`: `Some(param)` if so (`None` inside for a
/// template without one).
fn matches<'a>(template: &str, path: &'a str) -> Option<Option<&'a str>> {
    let Some((prefix, rest)) = template.split_once('{') else {
        return (template == path).then_some(None);
    };
    let suffix = rest.split_once('}').map_or("", |(_, s)| s);
    let param = path.strip_prefix(prefix)?.strip_suffix(suffix)?;
    // Only a parameter that ends the path may hold `/`.
    let fits = !param.is_empty() && (suffix.is_empty() || !param.contains('/'));
    fits.then_some(Some(param))
}

/// The API a generation request arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientApi {
    /// One of the endpoints keel also calls upstream.
    Endpoint(Endpoint),
    /// OpenAI's Responses API, which runs as Chat Completions (see `responses`).
    Responses,
}

impl ClientApi {
    /// The endpoint the request runs as.
    pub fn endpoint(self) -> Endpoint {
        match self {
            ClientApi::Endpoint(e) => e,
            ClientApi::Responses => Endpoint::ChatCompletions,
        }
    }

    /// The label in metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            ClientApi::Endpoint(e) => e.as_str(),
            ClientApi::Responses => crate::wire::responses::LABEL,
        }
    }
}

/// `%XX` escapes decoded (a model id may hold `/` or `:`); invalid ones are kept as they are.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    #[test]
    fn every_route_resolves_to_itself() {
        for r in ROUTES {
            let path = r
                .path
                .replace("{model_id}", "some/model")
                .replace("{key_id}", "some-key")
                .replace("{request_id}", "some-id");
            let method = Method::from_bytes(r.verb.as_str().as_bytes()).unwrap();
            match resolve(&method, &path) {
                Resolved::Route(t, _) => assert_eq!(t, r.target, "{path}"),
                other => panic!("{} {path} resolved to {other:?}", r.verb.as_str()),
            }
        }
    }

    #[test]
    fn model_ids_keep_their_slashes_and_wrong_methods_are_405() {
        assert_eq!(
            resolve(&Method::GET, "/v1/models/org/m:1"),
            Resolved::Route(Target::Model, Some("org/m:1"))
        );
        assert_eq!(
            resolve(&Method::DELETE, "/v1/models/x"),
            Resolved::MethodNotAllowed
        );
        assert_eq!(
            resolve(&Method::GET, "/v1/chat/completions"),
            Resolved::MethodNotAllowed
        );
        assert_eq!(
            resolve(&Method::POST, "/keel/openapi.json"),
            Resolved::MethodNotAllowed
        );
        assert_eq!(resolve(&Method::GET, "/v1/nope"), Resolved::NotFound);
        assert_eq!(
            resolve(&Method::GET, "/keel/keys/app-1/usage"),
            Resolved::Route(Target::KeyUsage, Some("app-1"))
        );
        assert_eq!(
            resolve(&Method::GET, "/keel/keys/a/b/usage"),
            Resolved::NotFound
        );
        assert_eq!(
            resolve(&Method::GET, "/keel/keys//usage"),
            Resolved::NotFound
        );
        assert_eq!(resolve(&Method::GET, "/v1/models/"), Resolved::NotFound);
    }
}
