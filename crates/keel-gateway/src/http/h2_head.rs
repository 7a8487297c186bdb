//! The HTTP/2 header-read timeout: a new stream's request head must arrive whole within
//! `header_read_timeout_ms` of its first frame, as an HTTP/1.1 request head must.
//!
//! Why: an HTTP/2 request head is a HEADERS frame and, when it does not fit one, CONTINUATION
//! frames until one carries END_HEADERS; nothing else may be sent on the connection in
//! between. hyper (through h2) has a size bound for the head but no time bound, so a client
//! that sent a HEADERS frame without END_HEADERS and then trickled CONTINUATION frames (or
//! nothing) held the connection, and the memory of the head so far, until keep-alive pings
//! went unanswered — and for ever if it answered them.
//!
//! [`HeadWatch`] wraps the socket and follows the frame boundaries in what is read (the
//! 9-byte frame headers; payloads are skipped unread), so it knows when a head is open: from
//! its HEADERS frame's header to the end of the frame that carries END_HEADERS. A read while a
//! head has been open for the limit fails with `TimedOut`, which ends the connection. hyper
//! always has a read pending on an HTTP/2 connection, so the timer (armed once per head that
//! does not arrive in the read that began it) wakes the connection's task to see it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// What a client sends first (RFC 9113, 3.4): not frames.
const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

/// Where the reader is in the client's frames.
#[derive(Debug)]
struct Frames {
    /// Preface bytes still to pass.
    preface_left: usize,
    /// The frame header being read, and how much of it is in.
    header: [u8; FRAME_HEADER_LEN],
    header_have: usize,
    /// Payload bytes of the current frame still to pass.
    payload_left: usize,
    /// The current frame ends a head (a head frame with END_HEADERS).
    ends_head: bool,
    /// A head is open: a head frame without END_HEADERS was seen and its last frame is not in.
    open: bool,
}

impl Frames {
    fn new() -> Frames {
        Frames {
            preface_left: PREFACE_LEN,
            header: [0; FRAME_HEADER_LEN],
            header_have: 0,
            payload_left: 0,
            ends_head: false,
            open: false,
        }
    }

    /// Follows `bytes`, the next ones read. Returns whether a head opened in them (it may
    /// have closed again by their end: see `open`).
    fn read(&mut self, mut bytes: &[u8]) -> bool {
        let mut opened = false;
        while !bytes.is_empty() {
            if self.preface_left > 0 {
                let n = self.preface_left.min(bytes.len());
                self.preface_left -= n;
                bytes = &bytes[n..];
            } else if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                bytes = &bytes[n..];
                if self.payload_left == 0 && self.ends_head {
                    self.open = false;
                }
            } else {
                let n = (FRAME_HEADER_LEN - self.header_have).min(bytes.len());
                self.header[self.header_have..self.header_have + n].copy_from_slice(&bytes[..n]);
                self.header_have += n;
                bytes = &bytes[n..];
                if self.header_have == FRAME_HEADER_LEN {
                    self.header_have = 0;
                    opened |= self.frame();
                }
            }
        }
        opened
    }

    /// A frame header is in; true when it opens a head.
    fn frame(&mut self) -> bool {
        let h = &self.header;
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let (kind, flags) = (h[3], h[4]);
        self.payload_left = len;
        let head_frame = matches!(kind, HEADERS | PUSH_PROMISE | CONTINUATION);
        self.ends_head = head_frame && flags & END_HEADERS != 0;
        let opened = head_frame && !self.open;
        if head_frame {
            self.open = true;
        }
        if self.ends_head && len == 0 {
            self.open = false;
        }
        opened
    }
}

/// A client's HTTP/2 socket whose request heads must each arrive within a limit.
pub struct HeadWatch<I> {
    io: I,
    frames: Frames,
    limit: Duration,
    /// Armed when a head stays open past the read that opened it.
    timer: Option<Pin<Box<Sleep>>>,
    /// The timer is set for the head open now.
    armed: bool,
    failed: bool,
}

impl<I> HeadWatch<I> {
    /// `io` right after the version was sniffed: the preface not read yet.
    pub fn new(io: I, limit: Duration) -> HeadWatch<I> {
        HeadWatch {
            io,
            frames: Frames::new(),
            limit,
            timer: None,
            armed: false,
            failed: false,
        }
    }
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "an HTTP/2 request head took longer than header_read_timeout_ms",
    )
}

impl<I: AsyncRead + Unpin> AsyncRead for HeadWatch<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(Err(timed_out()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            let opened = this.frames.read(&buf.filled()[before..]);
            if opened || !this.frames.open {
                this.armed = false;
            }
        }
        if !this.frames.open {
            return polled;
        }
        if !this.armed {
            this.armed = true;
            let until = Instant::now() + this.limit;
            match &mut this.timer {
                Some(t) => t.as_mut().reset(until),
                None => this.timer = Some(Box::pin(tokio::time::sleep_until(until))),
            }
        }
        let expired = this
            .timer
            .as_mut()
            .is_some_and(|t| t.as_mut().poll(cx).is_ready());
        if expired {
            this.failed = true;
            // Bytes read with it are dropped with the connection.
            return Poll::Ready(Err(timed_out()));
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for HeadWatch<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&1u32.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn a_head_is_open_from_its_headers_frame_to_the_end_of_its_last_frame() {
        let mut f = Frames::new();
        assert!(!f.read(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"));
        // SETTINGS and a whole head in one frame: never open at a read's end.
        assert!(!f.read(&frame(0x4, 0, &[0; 6])));
        assert!(f.read(&frame(HEADERS, END_HEADERS, &[0x82; 5])));
        assert!(!f.open);
        // A head split in frames, read byte by byte: open until its last payload byte.
        let mut split = frame(HEADERS, 0, &[0x82; 3]);
        split.extend(frame(CONTINUATION, 0, &[0x82; 3]));
        split.extend(frame(CONTINUATION, END_HEADERS, &[0x82; 3]));
        let (last, rest) = split.split_last().unwrap();
        let mut opened = false;
        for b in rest {
            opened |= f.read(std::slice::from_ref(b));
            assert!(f.open || !opened);
        }
        assert!(opened && f.open);
        assert!(!f.read(std::slice::from_ref(last)));
        assert!(!f.open);
        // Data frames never open one, however large.
        assert!(!f.read(&frame(0x0, 0, &[7; 20_000])));
        assert!(!f.open);
    }
}
