//! One HTTP/1.1 exchange on a connection of the direct pool: the request written in one
//! vectored write (when the socket takes it at once), the response head parsed with `httparse`
//! (hyper's own parser), and the body's framing (a length, chunked, or up to the close) decoded
//! in place, in the connection's one read buffer.
//!
//! Why not hyper's client connection: a live stream holds its upstream connection for its
//! whole life, and hyper's holds, besides the socket, a fixed 8 KiB write buffer (kept after
//! the request is written) and a dispatch channel of 32 request slots (≈ 9 KB), neither of
//! which its builder sizes, plus a channel between the connection and its body. Here a
//! connection is the socket and a read buffer of [`READ_BUF`] bytes; the request's head is
//! written from a buffer dropped as soon as it is sent, and a body chunk is a slice of the
//! read buffer, handed to the reader with no channel in between.
//!
//! What is accepted is what RFC 9112 asks of a client: informational (1xx) heads are skipped;
//! a body is delimited by `Transfer-Encoding` (chunked last; anything else: up to the close),
//! else by `Content-Length` (several different ones are an error), else by the close; 204 and
//! 304 have none. A connection is kept only after an HTTP/1.1 response without
//! `Connection: close`, framed by a length or by chunks, with nothing after its end.

use std::io::{self, IoSlice, Write as _};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::net::TcpStream;

/// Bytes read from an upstream connection at a time, and the read buffer's size. Holds a
/// response head and a streamed event with room to spare; a larger body is read in several
/// steps, and a larger head grows the buffer (up to [`MAX_HEAD`]).
pub const READ_BUF: usize = 4096;

/// The largest response head accepted (hyper's default limit is larger, but a model server's
/// head is a few hundred bytes; 64 KiB leaves room for proxies adding headers).
pub const MAX_HEAD: usize = 64 * 1024;

/// The most headers a response head may have.
const MAX_HEADERS: usize = 100;

/// The longest chunk-size line (with extensions) or trailer line accepted.
const MAX_LINE: usize = 4096;

/// The request's head: `POST`, its target, `host`, the given headers (less the framing and
/// connection headers, which are this exchange's to set) and the body's length.
pub fn request_head(
    path: &str,
    host: &HeaderValue,
    headers: &HeaderMap,
    body_len: usize,
) -> Vec<u8> {
    let size: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    let mut head = Vec::with_capacity(64 + path.len() + host.len() + size);
    head.extend_from_slice(b"POST ");
    head.extend_from_slice(path.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(host.as_bytes());
    head.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if [HOST, CONTENT_LENGTH, TRANSFER_ENCODING, CONNECTION].contains(name) {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    // Writing into a Vec cannot fail.
    let _ = write!(head, "content-length: {body_len}\r\n\r\n");
    head
}

/// What of a request is still to be sent: its head, then its body.
pub struct Unsent<'a> {
    head: &'a [u8],
    body: &'a [u8],
}

impl<'a> Unsent<'a> {
    pub fn new(head: &'a [u8], body: &'a [u8]) -> Self {
        Unsent { head, body }
    }

    pub fn is_empty(&self) -> bool {
        self.head.is_empty() && self.body.is_empty()
    }

    /// Sends what the socket takes now, head and body in one vectored write: `Ready(Ok)` once
    /// some was sent, `Pending` while the socket takes nothing (woken when it can take more).
    pub fn poll_send(&mut self, stream: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match stream.try_write_vectored(&[IoSlice::new(self.head), IoSlice::new(self.body)]) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    let from_head = n.min(self.head.len());
                    self.head = &self.head[from_head..];
                    self.body = &self.body[n - from_head..];
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    ready!(stream.poll_write_ready(cx))?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Reads what the socket has into `buf` (growing it to [`READ_BUF`] free bytes when it has
/// little room left): the count read, 0 at the connection's end.
///
/// Read through tokio's `AsyncRead`, which takes a read that leaves room in the buffer as the
/// socket drained and waits for the next readiness event before reading again. `try_read`
/// keeps the readiness until a read fails with `WouldBlock`: after a response head that
/// comes alone, the body's first read would be a system call that finds nothing, every
/// request.
pub fn poll_fill(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if buf.capacity() - buf.len() < READ_BUF / 4 {
        buf.reserve(READ_BUF);
    }
    loop {
        match tokio_util::io::poll_read_buf(Pin::new(&mut *stream), cx, buf) {
            Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

/// A response head, and how its body is delimited.
pub struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may take another request after this response's end.
    pub keep_alive: bool,
}

/// Parses a complete response head from the front of `buf`, skipping informational ones, and
/// consumes it: `Ok(None)` while it is incomplete.
pub fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, String> {
    loop {
        // Nothing to parse yet (the exchange asks before its first read): no head can be here.
        if buf.is_empty() {
            return Ok(None);
        }
        // Slots left uninitialized: the parser writes those it fills, and zeroing a hundred
        // of them on every try cost more than parsing a whole head.
        let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut []);
        let parsed = httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut resp, buf, &mut slots);
        let len = match parsed {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(format!(
                    "the upstream's response head has more than {MAX_HEADERS} headers"
                ))
            }
            Err(e) => return Err(format!("the upstream's response head is malformed: {e}")),
        };
        let code = resp.code.unwrap_or_default();
        let status = StatusCode::from_u16(code)
            .map_err(|_| format!("the upstream answered with status {code}"))?;
        if status.is_informational() {
            // `100 Continue`, `103 Early Hints`: a final head follows.
            buf.advance(len);
            continue;
        }
        // One copy of the head, which every header value is a slice of.
        let base = buf.as_ptr() as usize;
        let copy = Bytes::copy_from_slice(&buf[..len]);
        let mut headers = HeaderMap::with_capacity(resp.headers.len());
        let mut length: Option<u64> = None;
        let mut chunked = None;
        let mut close = resp.version != Some(1);
        for h in resp.headers.iter() {
            let name = HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| format!("the upstream sent a bad header name {:?}", h.name))?;
            let at = h.value.as_ptr() as usize - base;
            let value = HeaderValue::from_maybe_shared(copy.slice(at..at + h.value.len()))
                .map_err(|_| format!("the upstream sent a bad value for {name}"))?;
            if name == CONTENT_LENGTH {
                let n = value
                    .to_str()
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .ok_or_else(|| "the upstream sent a bad content-length".to_owned())?;
                if length.is_some_and(|l| l != n) {
                    return Err("the upstream sent two different content-lengths".into());
                }
                length = Some(n);
            } else if name == TRANSFER_ENCODING {
                // The last coding of the last header decides.
                let last = h.value.rsplit(|b| *b == b',').next().unwrap_or_default();
                chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            } else if name == CONNECTION {
                close |= h
                    .value
                    .split(|b| *b == b',')
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
            }
            headers.append(name, value);
        }
        buf.advance(len);
        let framing = if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Length(0)
        } else {
            match (chunked, length) {
                (Some(true), _) => Framing::Chunked(Chunk::Size),
                (Some(false), _) | (None, None) => Framing::Close,
                (None, Some(n)) => Framing::Length(n),
            }
        };
        // A length beside a transfer coding is a message a proxy might read otherwise: not
        // kept (RFC 9112 §6.3).
        let smuggled = chunked.is_some() && length.is_some();
        let keep_alive = !(close || smuggled || matches!(framing, Framing::Close));
        return Ok(Some(Head {
            status,
            headers,
            framing,
            keep_alive,
        }));
    }
}

/// How a response body ends.
pub enum Framing {
    /// This many bytes still to come.
    Length(u64),
    Chunked(Chunk),
    /// At the connection's close.
    Close,
}

/// Where a chunked body's decoding stands.
#[derive(Clone, Copy)]
pub enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data: this many bytes left.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines, up to an empty one.
    Trailers,
    Done,
}

/// What decoding the buffered bytes gave.
pub enum Decoded {
    Data(Bytes),
    End,
    /// More bytes are needed.
    More,
}

impl Framing {
    /// Takes the body's next piece from the front of `buf`. Data is a slice of the buffer, not
    /// a copy.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, String> {
        match self {
            Framing::Length(0) => Ok(Decoded::End),
            Framing::Length(left) => {
                if buf.is_empty() {
                    return Ok(Decoded::More);
                }
                let take = (*left).min(buf.len() as u64);
                *left -= take;
                Ok(Decoded::Data(buf.split_to(take as usize).freeze()))
            }
            Framing::Close => {
                if buf.is_empty() {
                    return Ok(Decoded::More);
                }
                Ok(Decoded::Data(buf.split().freeze()))
            }
            Framing::Chunked(state) => decode_chunked(state, buf),
        }
    }

    /// The connection's end: whether it ends the body cleanly.
    pub fn ends_at_close(&self) -> bool {
        matches!(self, Framing::Close | Framing::Length(0))
            || matches!(self, Framing::Chunked(Chunk::Done))
    }
}

fn decode_chunked(state: &mut Chunk, buf: &mut BytesMut) -> Result<Decoded, String> {
    loop {
        if let Chunk::Data(left) = *state {
            if buf.is_empty() {
                return Ok(Decoded::More);
            }
            let take = left.min(buf.len() as u64);
            *state = if take == left {
                Chunk::DataEnd
            } else {
                Chunk::Data(left - take)
            };
            return Ok(Decoded::Data(buf.split_to(take as usize).freeze()));
        }
        if let Chunk::Done = *state {
            return Ok(Decoded::End);
        }
        // Every other state reads a line.
        let Some(lf) = memchr::memchr(b'\n', buf) else {
            if buf.len() > MAX_LINE {
                return Err("the upstream sent a chunk line that does not end".into());
            }
            return Ok(Decoded::More);
        };
        let line = buf[..lf].strip_suffix(b"\r").unwrap_or(&buf[..lf]);
        *state = match *state {
            Chunk::Size => {
                let digits = line
                    .split(|b| *b == b';')
                    .next()
                    .unwrap_or_default()
                    .trim_ascii();
                let size = std::str::from_utf8(digits)
                    .ok()
                    .filter(|d| !d.is_empty() && d.len() <= 16)
                    .and_then(|d| u64::from_str_radix(d, 16).ok())
                    .ok_or_else(|| "the upstream sent a bad chunk size".to_owned())?;
                if size == 0 {
                    Chunk::Trailers
                } else {
                    Chunk::Data(size)
                }
            }
            Chunk::DataEnd if line.is_empty() => Chunk::Size,
            Chunk::DataEnd => return Err("the upstream sent a chunk longer than its size".into()),
            Chunk::Trailers if line.is_empty() => Chunk::Done,
            other => other,
        };
        buf.advance(lf + 1);
    }
}

/// Fuzz harness (`upstream_response`): the bytes after the first as an upstream's answer, fed
/// to the parser in pieces of 1 to 64 bytes (the first byte sets the size): its head, then its
/// body to the end or an error. Any result is fine; a panic is not, nor a body longer than what
/// was sent or than its declared length.
pub fn fuzz_response(data: &[u8]) {
    let Some((&step, wire)) = data.split_first() else {
        return;
    };
    let step = usize::from(step % 64) + 1;
    let mut fed = 0;
    let mut feed = |buf: &mut BytesMut| -> bool {
        if fed >= wire.len() {
            return false;
        }
        let to = (fed + step).min(wire.len());
        buf.extend_from_slice(&wire[fed..to]);
        fed = to;
        true
    };
    let mut buf = BytesMut::new();
    let head = loop {
        match parse_head(&mut buf) {
            Ok(Some(head)) => break head,
            Ok(None) if buf.len() < MAX_HEAD && feed(&mut buf) => {}
            _ => return,
        }
    };
    let declared = match head.framing {
        Framing::Length(n) => Some(n),
        _ => None,
    };
    let mut framing = head.framing;
    let mut body = 0u64;
    loop {
        match framing.decode(&mut buf) {
            Ok(Decoded::Data(d)) => {
                assert!(!d.is_empty(), "an empty piece of body");
                body += d.len() as u64;
                assert!(body <= wire.len() as u64, "more body than bytes sent");
                assert!(
                    declared.is_none_or(|n| body <= n),
                    "more body than declared"
                );
            }
            Ok(Decoded::More) if feed(&mut buf) => {}
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(framing: &mut Framing, wire: &[u8], step: usize) -> Result<Vec<u8>, String> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match framing.decode(&mut buf)? {
                Decoded::Data(d) => out.extend_from_slice(&d),
                Decoded::End => return Ok(out),
                Decoded::More if fed < wire.len() => {
                    let to = (fed + step).min(wire.len());
                    buf.extend_from_slice(&wire[fed..to]);
                    fed = to;
                }
                Decoded::More => return Err("more wanted at the end".into()),
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_however_the_bytes_arrive() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        for step in [1, 2, 3, 7, wire.len()] {
            let mut f = Framing::Chunked(Chunk::Size);
            assert_eq!(
                decode_all(&mut f, wire, step).unwrap(),
                b"hello, world",
                "step {step}"
            );
            assert!(f.ends_at_close());
        }
        // Bare LFs, as some servers send.
        let mut f = Framing::Chunked(Chunk::Size);
        assert_eq!(decode_all(&mut f, b"3\nabc\n0\n\n", 1).unwrap(), b"abc");
    }

    #[test]
    fn bad_chunks_are_errors() {
        for wire in [
            &b"zz\r\nhello\r\n0\r\n\r\n"[..],
            b"3\r\nhello\r\n0\r\n\r\n",
            b"\r\n",
        ] {
            let mut f = Framing::Chunked(Chunk::Size);
            assert!(
                decode_all(&mut f, wire, 4).is_err(),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[test]
    fn a_length_ends_its_body() {
        let mut f = Framing::Length(5);
        let mut buf = BytesMut::from(&b"hel"[..]);
        assert!(matches!(f.decode(&mut buf), Ok(Decoded::Data(d)) if d == "hel"));
        assert!(!f.ends_at_close(), "two bytes are missing");
        buf.extend_from_slice(b"loNEXT");
        assert!(matches!(f.decode(&mut buf), Ok(Decoded::Data(d)) if d == "lo"));
        assert!(matches!(f.decode(&mut buf), Ok(Decoded::End)));
        assert_eq!(&buf[..], b"NEXT", "what follows is left in the buffer");
    }

    fn head(wire: &str) -> Head {
        let mut buf = BytesMut::from(wire.as_bytes());
        parse_head(&mut buf).unwrap().expect("a whole head")
    }

    #[test]
    fn heads_say_how_the_body_ends_and_whether_the_connection_is_kept() {
        let h = head("HTTP/1.1 200 OK\r\ncontent-length: 12\r\nx-a: b\r\n\r\n");
        assert!(matches!(h.framing, Framing::Length(12)) && h.keep_alive);
        assert_eq!(h.headers["x-a"], "b");
        let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n");
        assert!(matches!(h.framing, Framing::Chunked(_)) && h.keep_alive);
        let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n");
        assert!(matches!(h.framing, Framing::Chunked(_)) && !h.keep_alive);
        let h = head("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n");
        assert!(matches!(h.framing, Framing::Close) && !h.keep_alive);
        let h =
            head("HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n");
        assert!(!h.keep_alive);
        let h = head("HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n");
        assert!(!h.keep_alive);
        let h = head("HTTP/1.1 204 No Content\r\n\r\n");
        assert!(matches!(h.framing, Framing::Length(0)) && h.keep_alive);
        let h = head("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(h.status, 429);
        assert_eq!(h.headers["retry-after"], "3");
    }

    #[test]
    fn bad_heads_are_errors_and_partial_ones_wait() {
        let mut buf = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-le"[..]);
        assert!(matches!(parse_head(&mut buf), Ok(None)));
        for wire in [
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            "SMTP ready\r\n\r\n",
        ] {
            let mut buf = BytesMut::from(wire.as_bytes());
            assert!(parse_head(&mut buf).is_err(), "{wire:?}");
        }
    }

    #[test]
    fn a_request_head_carries_its_own_framing() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer k"));
        headers.insert(CONTENT_LENGTH, HeaderValue::from_static("999"));
        headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        let head = request_head(
            "/v1/chat/completions",
            &HeaderValue::from_static("h:1"),
            &headers,
            7,
        );
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "POST /v1/chat/completions HTTP/1.1\r\nhost: h:1\r\nauthorization: Bearer k\r\ncontent-length: 7\r\n\r\n"
        );
    }
}
