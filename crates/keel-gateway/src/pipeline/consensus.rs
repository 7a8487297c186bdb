//! Consensus (`x-keel-consensus: N`, opt-in per request): a structured-output request sent to N
//! variants at once, the answers merged field by field (`keel_core::integrity::vote`: the
//! majority value of each field, ties to the fastest answer).
//!
//! **Who may ask.** A non-streaming chat request whose `response_format` is `json_object` or
//! `json_schema` (a Responses request with `text.format` of those types counts too), with
//! `2 ≤ N ≤` the pool's number of variants. Anything else is refused with a 400 in the
//! client's protocol at admission, before any limit is charged: a streamed answer cannot be
//! voted on before it is sent, and text has no fields.
//!
//! **How it runs.** The plan's first N variants (then the pool's others, should the plan be
//! shorter) are entered like any attempt (`settlement`): the first as the request's first
//! attempt, each other as a hedge, so the pool's hedge budget bounds the extra load: each
//! answer asked for counts as a request of the pool and each extra one as a hedge (at
//! `hedge_budget = 1.0` every consensus runs in full; at the default 0.1 a quiet pool gets two
//! answers). A variant the budget or its concurrency limit refuses is skipped for the next. All run at once; each is settled
//! as it ends. Answers that are not the JSON asked for are left out of the vote; with no valid
//! answer the fastest answer is returned flagged `x-keel-integrity: invalid_json`.
//!
//! **What the client sees.** The fastest valid answer's body with its content replaced by the
//! merged JSON; `x-keel-route: consensus`; `x-keel-consensus-agreement`: the share of fields on
//! which all valid answers agreed (two decimals); `x-keel-consensus-fields`:
//! `agreed/total`; `x-keel-consensus-answers`: valid answers voted / variants asked. The
//! decision record's `consensus` names the variants in the order they answered and, for each
//! field without unanimity, which variants' values won and which did not (never the values:
//! records keep no output).

use crate::observe::record::AttemptKind;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{json, Value};

use keel_core::integrity::{json as ijson, vote};
use keel_core::outcome::AttemptFailure;
use keel_core::protocol::{Endpoint, ErrorKind};
use keel_core::request::CanonicalRequest;

use crate::pipeline::attempt::{attempt, Served};
use crate::pipeline::context::RequestCtx;
use crate::pipeline::phases::Flight;
use crate::pipeline::settlement::{Attempts, Entered, Settled, StreamEnd};
use crate::state::pools::Pool;
use crate::wire::body::Body;
use crate::wire::errors::GatewayError;

/// The request header.
pub const HEADER: http::HeaderName = http::HeaderName::from_static("x-keel-consensus");

/// The consensus a request asks for (`None` without the header), or the client's 400.
pub fn requested(
    headers: &HeaderMap,
    pool: &Pool,
    endpoint: Endpoint,
    req: &CanonicalRequest,
) -> Result<Option<usize>, GatewayError> {
    let Some(raw) = headers.get(HEADER) else {
        return Ok(None);
    };
    let bad = |m: String| {
        Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            format!("{HEADER}: {m}"),
        ))
    };
    let text = raw.to_str().unwrap_or("").trim();
    let Ok(n) = text.parse::<usize>() else {
        return bad(format!(
            "expected the number of variants to ask (2 or more), got `{text}`"
        ));
    };
    let size = pool.variants.len();
    if n < 2 {
        return bad(format!(
            "at least 2 variants are needed for a consensus, got {n}"
        ));
    }
    if n > size {
        return bad(format!(
            "`{}` has {size} variant{}; a consensus of {n} is not possible",
            pool.cfg.name,
            if size == 1 { "" } else { "s" }
        ));
    }
    if req.stream {
        return bad(
            "a streamed answer cannot be voted on before it is sent; ask without `stream`".into(),
        );
    }
    if endpoint != Endpoint::ChatCompletions || ijson::expected(&req.body).is_none() {
        return bad("only structured-output requests can be voted on (chat completions with `response_format` of type `json_object` or `json_schema`)".into());
    }
    Ok(Some(n))
}

/// One answer: the variant, and the body it gave.
struct Answer {
    vi: usize,
    status: StatusCode,
    headers: HeaderMap,
    body: bytes::Bytes,
}

/// Runs a consensus of `n` over `order` for the request in `flight` and answers the client.
pub async fn run(
    flight: Flight<'_>,
    order: &[usize],
    mut attempts: Attempts,
    n: usize,
) -> http::Response<Body> {
    let Flight {
        mut log,
        pool,
        ctx,
        req,
        ..
    } = flight;
    let (pool, ctx, req) = (&pool, &ctx, &req);
    pool.count_request();
    let protocol = ctx.endpoint.protocol();
    let entered = enter(pool, ctx, req, order, &mut attempts, n).await;
    let asked = entered.len();
    let mut running: FuturesUnordered<_> = entered
        .into_iter()
        .map(|e| async move {
            let r = attempt(pool, e.vi, req, ctx, e.traceparent()).await;
            (e, r)
        })
        .collect();
    // Settled in the order they end: the first answer is the fastest.
    let mut answers = Vec::new();
    let mut client_error = None;
    while let Some((e, r)) = running.next().await {
        match attempts.settle(e, r) {
            Settled::Served(
                c,
                Served::Whole {
                    status,
                    headers,
                    body,
                    usage,
                },
            ) => {
                ctx.meter
                    .whole_or_read(&pool.variants[c.vi].cfg, usage, &body);
                answers.push(Answer {
                    vi: c.vi,
                    status,
                    headers,
                    body,
                });
            }
            Settled::Served(c, Served::Stream(_)) => {
                let f =
                    AttemptFailure::Malformed("answered a consensus request with a stream".into());
                attempts.settle_end(c, StreamEnd::Failed(f));
            }
            Settled::ClientError(s) => {
                client_error.get_or_insert(s);
            }
            Settled::Failed => {}
        }
    }
    drop(running);
    log.note_attempts(&attempts);
    log.route = "consensus";
    let expected = ijson::expected(&req.body).unwrap_or(ijson::Expected::Object);
    let valid: Vec<(usize, Value)> = answers
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            let body: Value = serde_json::from_slice(&a.body).ok()?;
            let parsed = ijson::check(ijson::answer_text(&body)?, &expected).ok()?;
            Some((i, parsed))
        })
        .collect();
    let Some(&(first, _)) = valid.first() else {
        // No valid answer: the fastest as it is, flagged; or why nothing answered.
        count(pool, "no_valid_answer");
        if let Some(a) = answers.into_iter().next() {
            log.serving(&pool.variants[a.vi].cfg);
            let mut resp = crate::pipeline::delivery::whole(log, ctx, a.status, a.headers, a.body);
            crate::pipeline::delivery::integrity_header(resp.headers_mut(), &["invalid_json"]);
            return resp;
        }
        if let Some(Served::Whole {
            status,
            headers,
            body,
            ..
        }) = client_error
        {
            return crate::pipeline::delivery::whole(log, ctx, status, headers, body);
        }
        return crate::pipeline::delivery::error_response(
            log,
            protocol,
            &attempts.give_up_error(ctx),
        );
    };
    let values: Vec<Value> = valid.iter().map(|(_, v)| v.clone()).collect();
    let consensus = vote::merge(&values);
    let names: Vec<&str> = valid
        .iter()
        .map(|(i, _)| pool.variants[answers[*i].vi].cfg.name.as_str())
        .collect();
    if let Some(d) = attempts.decision() {
        d.update(|r| r.consensus = Some(record(&consensus, &names, asked)));
    }
    drop(attempts);
    let chosen = answers.swap_remove(first);
    let mut body: Value = serde_json::from_slice(&chosen.body).unwrap_or(Value::Null);
    if let Some(content) = body.pointer_mut("/choices/0/message/content") {
        *content = Value::String(consensus.merged.to_string());
    }
    log.serving(&pool.variants[chosen.vi].cfg);
    let bytes = bytes::Bytes::from(body.to_string());
    let mut resp = crate::pipeline::delivery::whole(log, ctx, chosen.status, chosen.headers, bytes);
    let h = resp.headers_mut();
    let put = |h: &mut HeaderMap, name: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(name, v);
        }
    };
    put(
        h,
        "x-keel-consensus-agreement",
        format!("{:.2}", consensus.agreement()),
    );
    put(
        h,
        "x-keel-consensus-fields",
        format!("{}/{}", consensus.fields_agreed, consensus.fields_total),
    );
    put(
        h,
        "x-keel-consensus-answers",
        format!("{}/{asked}", values.len()),
    );
    let result = if consensus.disagreements.is_empty() {
        "unanimous"
    } else {
        "split"
    };
    count(pool, result);
    resp
}

/// Counts a consensus by result: `unanimous`, `split` (some field disagreed), `no_valid_answer`.
fn count(pool: &Pool, result: &'static str) {
    pool.metrics
        .counter(
            "keel_consensus_total",
            &[("pool", &pool.cfg.name), ("result", result)],
        )
        .increment(1);
}

/// Enters up to `n` variants: the plan's, then the pool's others; the first as the request's
/// first attempt, the others as hedges within the pool's hedge budget.
async fn enter(
    pool: &Arc<Pool>,
    ctx: &RequestCtx,
    req: &CanonicalRequest,
    order: &[usize],
    attempts: &mut Attempts,
    n: usize,
) -> Vec<Entered> {
    let others = (0..pool.variants.len()).filter(|i| !order.contains(i));
    let candidates: Vec<usize> = order.iter().copied().chain(others).collect();
    let mut entered = Vec::new();
    for vi in candidates {
        if entered.len() == n {
            break;
        }
        if crate::upstream::translation::check(&pool.variants[vi].cfg, req).is_err() {
            continue;
        }
        let kind = if entered.is_empty() {
            AttemptKind::First
        } else {
            // Each answer asked for is a request of the pool, each extra one a hedge: the
            // hedge budget's share applies to the upstream requests a consensus makes.
            pool.count_request();
            if pool.try_hedge(&[vi]).is_none() {
                continue;
            }
            AttemptKind::Hedge
        };
        if let Ok(e) = attempts.enter(vi, kind, ctx.deadline).await {
            entered.push(e);
        }
    }
    entered
}

/// The decision record's `consensus`: who answered, how far they agreed, and for each field
/// without unanimity which variants' values won.
fn record(c: &vote::Consensus, names: &[&str], asked: usize) -> Value {
    let disagreements: Vec<Value> = c
        .disagreements
        .iter()
        .map(|d| {
            let (mut agreeing, mut differing) = (Vec::new(), Vec::new());
            for (v, name) in d.values.iter().zip(names) {
                if *v == d.chosen {
                    agreeing.push(*name);
                } else {
                    differing.push(*name);
                }
            }
            json!({"field": d.field, "agreeing": agreeing, "differing": differing, "left_out": d.chosen.is_none()})
        })
        .collect();
    json!({
        "asked": asked,
        "answered": names,
        "agreement": c.agreement(),
        "fields_agreed": c.fields_agreed,
        "fields_total": c.fields_total,
        "disagreements": disagreements,
    })
}
