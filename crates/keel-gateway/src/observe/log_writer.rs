//! Log lines — the access log and keel's own — written by a thread of their own, never by a
//! request's task.
//!
//! A write to stdout blocks once the pipe behind it is full (a log shipper that pauses, a container
//! runtime's reader that falls behind), and a write to a file blocks when the disk does. Written
//! from the runtime's workers, such a write stalled every request on that worker: a `keel serve`
//! whose stdout pipe nobody read answered 143 requests (the pipe's 64 KiB of lines) and then none.
//! Here a line is queued (at most [`QUEUE_LINES`]) and the writer thread, every few milliseconds,
//! writes whatever has queued in one system call per destination. When the queue is full the line
//! is dropped and counted ([`dropped`], `keel_log_lines_dropped_total`): losing log lines is the
//! lesser harm than stalling requests, and the count says that it happened.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Lines that may wait for the writer (≈ 7 MiB of 450-byte access lines).
pub const QUEUE_LINES: usize = 16_384;

/// How long the writer lets lines gather before writing them: log lines appear at most this
/// late.
const BATCH_WAIT: Duration = Duration::from_millis(5);

/// The most bytes written in one system call.
const BATCH_BYTES: usize = 64 << 10;

/// Where a line goes.
#[derive(Clone)]
pub enum Dest {
    Stdout,
    Stderr,
    File(Arc<File>),
}

impl Dest {
    fn same(&self, other: &Dest) -> bool {
        match (self, other) {
            (Dest::Stdout, Dest::Stdout) | (Dest::Stderr, Dest::Stderr) => true,
            (Dest::File(a), Dest::File(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Writes `bytes` (whole lines); a failed write is dropped: a full disk must not fail
    /// requests, and there is nowhere left to report it.
    fn write(&self, bytes: &[u8]) {
        let _ = match self {
            Dest::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(bytes).and_then(|_| out.flush())
            }
            Dest::Stderr => std::io::stderr().lock().write_all(bytes),
            Dest::File(f) => (&**f).write_all(bytes),
        };
    }
}

enum Msg {
    Line(Dest, Vec<u8>),
    /// Answered once everything queued before it is written.
    Flush(SyncSender<()>),
}

/// A queue and the thread that empties it.
struct Writer {
    tx: Option<SyncSender<Msg>>,
    dropped: AtomicU64,
}

impl Writer {
    fn start(capacity: usize) -> Writer {
        let (tx, rx) = mpsc::sync_channel(capacity);
        let spawned = std::thread::Builder::new()
            .name("keel-log".into())
            .spawn(move || run(rx));
        Writer {
            // Without a thread (the process is out of them) lines are written in place.
            tx: spawned.ok().map(|_| tx),
            dropped: AtomicU64::new(0),
        }
    }

    fn write(&self, dest: &Dest, line: Vec<u8>) {
        let Some(tx) = &self.tx else {
            dest.write(&line);
            return;
        };
        match tx.try_send(Msg::Line(dest.clone(), line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Waits, at most `timeout`, until every line queued so far is written.
    fn flush(&self, timeout: Duration) -> bool {
        let Some(tx) = &self.tx else { return true };
        let deadline = Instant::now() + timeout;
        let (ack, done) = mpsc::sync_channel(1);
        let mut msg = Msg::Flush(ack);
        loop {
            match tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return false,
                Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(TrySendError::Full(_)) => return false,
            }
        }
        done.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }
}

/// The writer thread: takes what has queued, writes it batched by destination, and waits for
/// more.
fn run(rx: Receiver<Msg>) {
    let mut batch: Vec<u8> = Vec::new();
    let mut batch_dest: Option<Dest> = None;
    fn write_out(batch: &mut Vec<u8>, dest: &Option<Dest>) {
        if let (Some(d), false) = (dest, batch.is_empty()) {
            d.write(batch);
        }
        batch.clear();
    }
    while let Ok(first) = rx.recv() {
        // Let lines gather: the thread then wakes at most every BATCH_WAIT, not for every
        // line, and a request's task only queues (a sender wakes the thread only while it
        // waits in `recv`). On a core shared with the runtime's worker, a wake-up a line was a
        // thread switch a request.
        std::thread::sleep(BATCH_WAIT);
        for msg in std::iter::once(first).chain(rx.try_iter()) {
            match msg {
                Msg::Line(dest, line) => {
                    let other = batch_dest.as_ref().is_some_and(|d| !d.same(&dest));
                    if other || batch.len() + line.len() > BATCH_BYTES {
                        write_out(&mut batch, &batch_dest);
                    }
                    batch.extend_from_slice(&line);
                    batch_dest = Some(dest);
                }
                Msg::Flush(ack) => {
                    write_out(&mut batch, &batch_dest);
                    let _ = ack.try_send(());
                }
            }
        }
        write_out(&mut batch, &batch_dest);
        // A line of a few KiB made the batch grow; do not keep that for an idle process.
        if batch.capacity() > BATCH_BYTES {
            batch = Vec::new();
        }
    }
}

/// Started by the first line written, not before: a process that logs nothing has no thread.
static WRITER: OnceLock<Writer> = OnceLock::new();

fn writer() -> &'static Writer {
    WRITER.get_or_init(|| Writer::start(QUEUE_LINES))
}

/// Queues `line` (whole lines, newline included) for `dest`; never blocks.
pub fn write(dest: &Dest, line: Vec<u8>) {
    writer().write(dest, line)
}

/// Lines dropped because the queue was full, since the process started.
pub fn dropped() -> u64 {
    WRITER
        .get()
        .map_or(0, |w| w.dropped.load(Ordering::Relaxed))
}

/// Waits, at most `timeout`, until every line queued so far is written (at exit); false when it
/// could not.
pub fn flush(timeout: Duration) -> bool {
    WRITER.get().is_none_or(|w| w.flush(timeout))
}

/// keel's own log lines (`tracing`'s formatter), on stdout through the same queue: each event
/// is formatted whole and handed over in one `write`.
#[derive(Clone, Copy, Default)]
pub struct Stdout;

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        write(&Dest::Stdout, buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn file_in(dir: &std::path::Path, name: &str) -> (Arc<File>, std::path::PathBuf) {
        let path = dir.join(name);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        (Arc::new(f), path)
    }

    #[test]
    fn lines_arrive_whole_and_in_order_once_flushed() {
        let dir = std::env::temp_dir().join(format!("keel-log-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, a_path) = file_in(&dir, "a.log");
        let (b, b_path) = file_in(&dir, "b.log");
        let w = Writer::start(QUEUE_LINES);
        for i in 0..1000 {
            let (dest, tag) = if i % 3 == 0 { (&b, "b") } else { (&a, "a") };
            w.write(
                &Dest::File(dest.clone()),
                format!("{tag} {i}\n").into_bytes(),
            );
        }
        assert!(w.flush(Duration::from_secs(10)));
        let a_text = std::fs::read_to_string(&a_path).unwrap();
        let b_text = std::fs::read_to_string(&b_path).unwrap();
        let want_a: String = (0..1000)
            .filter(|i| i % 3 != 0)
            .map(|i| format!("a {i}\n"))
            .collect();
        let want_b: String = (0..1000)
            .filter(|i| i % 3 == 0)
            .map(|i| format!("b {i}\n"))
            .collect();
        assert_eq!(a_text, want_a);
        assert_eq!(b_text, want_b);
        assert_eq!(w.dropped.load(Ordering::Relaxed), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The case this module exists for: a destination that stops taking lines (a pipe nobody
    /// reads) never blocks the writer's callers; once the queue is full, lines are dropped and
    /// counted; once the reader comes back, queued lines flow again.
    #[test]
    fn a_destination_that_blocks_never_blocks_the_caller() {
        let (mut reader, pipe_writer) = std::io::pipe().unwrap();
        let dest = Dest::File(Arc::new(File::from(std::os::fd::OwnedFd::from(
            pipe_writer,
        ))));
        let w = Writer::start(64);
        let line = vec![b'x'; 1023]
            .into_iter()
            .chain([b'\n'])
            .collect::<Vec<u8>>();
        // 64 KiB fill the pipe, 64 lines the queue: 2,000 lines cannot all be taken. (Before
        // this module, the first write past the pipe's 64 KiB never returned.)
        for _ in 0..2000 {
            w.write(&dest, line.clone());
        }
        let dropped = w.dropped.load(Ordering::Relaxed);
        assert!(dropped > 0 && dropped < 2000, "dropped {dropped}");
        // The reader comes back: what was queued is written.
        let reading = std::thread::spawn(move || {
            let mut all = Vec::new();
            let _ = reader.read_to_end(&mut all);
            all.len()
        });
        assert!(w.flush(Duration::from_secs(10)));
        drop(w);
        drop(dest);
        let read = reading.join().unwrap();
        assert_eq!(read as u64, (2000 - dropped) * 1024);
    }
}
