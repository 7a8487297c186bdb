//! Restoring a guarded request's placeholders in its streamed answer: a body over the relay's
//! body, decoding its events and passing each through `keel_core::guard::stream`. It sits
//! after the relay (so the cache's copy and a migration's continuation keep the masked form)
//! and before the Responses front (which translates restored Chat events).

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use keel_core::guard::mask::Counts;
use keel_core::guard::stream::{Answering, StreamRestorer};
use keel_core::protocol::Protocol;
use keel_core::sse::{SseDecoder, SseEvent};

use crate::pipeline::guard::Guarded;
use crate::wire::body::Body;

/// `body` with the request's placeholders restored, or `body` itself when nothing was masked.
pub fn restore(body: Body, protocol: Protocol, guarded: Option<&Arc<Guarded>>) -> Body {
    let Some(g) = guarded.filter(|g| !g.masker.is_empty() || !g.answer.is_empty()) else {
        return body;
    };
    let state = Restoring {
        inner: body,
        decoder: SseDecoder::new(),
        restorer: StreamRestorer::new(protocol),
        guarded: g.clone(),
        counts: Counts::default(),
        finished: false,
    };
    let frames = futures_util::stream::unfold(state, |mut s| async move {
        let next = s.next().await?;
        Some((next, s))
    });
    http_body_util::StreamBody::new(frames).boxed()
}

struct Restoring {
    inner: Body,
    decoder: SseDecoder,
    restorer: StreamRestorer,
    guarded: Arc<Guarded>,
    /// The answer direction's findings, counted when the stream ends.
    counts: Counts,
    finished: bool,
}

impl Drop for Restoring {
    fn drop(&mut self) {
        self.guarded.count_answer(&self.counts);
    }
}

impl Restoring {
    async fn next(&mut self) -> Option<Result<Frame<Bytes>, io::Error>> {
        if self.finished {
            return None;
        }
        loop {
            let mut events = Vec::new();
            match self.inner.frame().await {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if self.decoder.feed(&data, &mut events).is_err() {
                        // keel's own relay wrote it: never expected; passed on as it came.
                        self.finished = true;
                        return Some(Ok(Frame::data(data)));
                    }
                }
                Some(Err(e)) => {
                    self.finished = true;
                    return Some(Err(e));
                }
                None => {
                    self.finished = true;
                    let _ = self.decoder.end(&mut events);
                    let out = self.pass(&events);
                    return (!out.is_empty()).then(|| Ok(Frame::data(Bytes::from(out))));
                }
            }
            let out = self.pass(&events);
            if !out.is_empty() {
                return Some(Ok(Frame::data(Bytes::from(out))));
            }
        }
    }

    fn pass(&mut self, events: &[SseEvent]) -> Vec<u8> {
        let mut out = Vec::new();
        let g = &self.guarded;
        let mut a = Answering {
            masker: &g.masker,
            guard: &g.guard,
            policy: &g.answer,
            counts: &mut self.counts,
        };
        for ev in events {
            self.restorer.event(&mut a, ev, &mut out);
        }
        out
    }
}
