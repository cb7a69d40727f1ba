//! The per-transfer timeline: where a step's time goes, recorded rather
//! than inferred.
//!
//! Each probe records a *span* (a name, a start and an end on the thread
//! that ran it, and what it moved: step, bytes, key). Spans of the library
//! (a tensor's `send` call, its `write` into the peer's memory, the
//! receiver's handling of its `arrival`, the `deliver` callback into
//! TensorFlow, the slot's `release`, ...) and of the TensorFlow shim
//! (`RecvFromRemote`, `RunGraph`, ... through [`record_external`]) go to
//! two places:
//! - this process's buffer, while recording is on (`RDMA_DEVICE_TRACE=1`,
//!   or [`set_enabled`]); [`take_chrome_json`] empties it as Chrome trace
//!   events (`ph: "X"`), which `python -m rdma_device.bench trace` merges
//!   across tasks into one file for chrome://tracing or Perfetto;
//! - TensorFlow's own profiler, while it records (the shim hands us its
//!   trace level and a sink, [`attach_tf`]): the spans then appear in
//!   TensorBoard's trace viewer next to TensorFlow's ops, on the thread
//!   that ran them.
//!
//! Clock: `CLOCK_REALTIME` in nanoseconds, the clock of TensorFlow's
//! profiler (`tsl::EnvTime::NowNanos`), so spans of several processes on
//! one host and TensorFlow's events line up.
//!
//! Cost: off, one relaxed atomic load per probe (and one more for
//! TensorFlow's level). On, two clock reads, a thread-id lookup and a
//! push under an uncontended lock per span; the buffer holds at most
//! [`MAX_SPANS`] spans (later ones are counted as dropped, never grown).
//!
//! Threads: probes run on whatever thread does the work, progress threads
//! included: they never block (one short lock) and never call TensorFlow
//! except through the sink, which only appends to TensorFlow's per-thread
//! event queue.

use std::cell::Cell;
use std::ffi::c_char;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, Ordering};

use parking_lot::Mutex;

/// Most spans kept between two `take`s (~100 bytes each).
pub const MAX_SPANS: usize = 1 << 20;

static ON: AtomicBool = AtomicBool::new(false);
/// TensorFlow's trace level (`tsl::profiler::internal::g_trace_level`), if
/// the shim attached it: >= 1 while TensorFlow's profiler records.
static TF_LEVEL: AtomicPtr<AtomicI32> = AtomicPtr::new(std::ptr::null_mut());
static TF_SINK: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());
static DROPPED: AtomicU64 = AtomicU64::new(0);
static SPANS: Mutex<Vec<Span>> = parking_lot::const_mutex(Vec::new());

/// Hands one span to TensorFlow's profiler: `name` (UTF-8, TraceMe's
/// `name#k=v,...#` form, not NUL-terminated), start and end in ns.
pub type TfSink = unsafe extern "C" fn(name: *const c_char, name_len: usize, start_ns: i64, end_ns: i64);

/// One recorded span.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: Name,
    pub start_ns: i64,
    pub end_ns: i64,
    pub tid: i32,
    pub step: u64,
    pub bytes: u64,
    pub key: Option<Box<str>>,
}

/// A span's name: the library's own, or one the shim gave.
#[derive(Debug, Clone)]
pub enum Name {
    Static(&'static str),
    Owned(Box<str>),
}

impl Name {
    pub fn as_str(&self) -> &str {
        match self {
            Name::Static(s) => s,
            Name::Owned(s) => s,
        }
    }
}

/// Whether a probe should record now (recording on, or TensorFlow's
/// profiler on).
#[inline]
pub fn active() -> bool {
    ON.load(Ordering::Relaxed) || tf_active()
}

#[inline]
fn tf_active() -> bool {
    let p = TF_LEVEL.load(Ordering::Relaxed);
    // SAFETY: the shim passes the address of TensorFlow's static level,
    // which lives as long as the process.
    !p.is_null() && unsafe { &*p }.load(Ordering::Relaxed) >= 1
}

/// Turn recording into this process's buffer on or off.
pub fn set_enabled(on: bool) {
    ON.store(on, Ordering::SeqCst);
}

pub fn enabled() -> bool {
    ON.load(Ordering::SeqCst)
}

/// Attach TensorFlow's profiler: its trace level and a sink for our spans.
///
/// # Safety
/// `level` points to an atomic int that lives as long as the process;
/// `sink` may be called from any thread at any time from now on.
pub unsafe fn attach_tf(level: *const AtomicI32, sink: TfSink) {
    TF_SINK.store(sink as *mut (), Ordering::SeqCst);
    TF_LEVEL.store(level as *mut AtomicI32, Ordering::SeqCst);
}

/// Now, in the trace's clock (ns).
#[inline]
pub fn now() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// A probe's start: `now()` when recording, 0 (nothing) when not.
#[inline]
pub fn start() -> i64 {
    if active() {
        now()
    } else {
        0
    }
}

fn tid() -> i32 {
    thread_local!(static TID: Cell<i32> = const { Cell::new(0) });
    TID.with(|t| {
        if t.get() == 0 {
            // SAFETY: plain syscall.
            t.set(unsafe { libc::gettid() });
        }
        t.get()
    })
}

/// End the span `name` begun at `start` (from [`start`]; 0: nothing was
/// recording then, so nothing is recorded).
#[inline]
pub fn end(name: &'static str, start: i64, step: u64, bytes: u64, key: Option<&str>) {
    if start != 0 {
        record(Name::Static(name), start, now(), step, bytes, key);
    }
}

/// A span the shim measured (`RecvFromRemote`, `RunGraph`, ...).
pub fn record_external(name: &str, start_ns: i64, end_ns: i64, step: u64, bytes: u64, key: Option<&str>) {
    if active() && start_ns > 0 && end_ns >= start_ns {
        record(Name::Owned(name.into()), start_ns, end_ns, step, bytes, key);
    }
}

fn record(name: Name, start_ns: i64, end_ns: i64, step: u64, bytes: u64, key: Option<&str>) {
    if tf_active() {
        to_tf(name.as_str(), start_ns, end_ns, step, bytes, key);
    }
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let span = Span { name, start_ns, end_ns, tid: tid(), step, bytes, key: key.map(Box::from) };
    let mut v = SPANS.lock();
    if v.len() >= MAX_SPANS || v.try_reserve(1).is_err() {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    v.push(span);
}

fn to_tf(name: &str, start_ns: i64, end_ns: i64, step: u64, bytes: u64, key: Option<&str>) {
    let sink = TF_SINK.load(Ordering::Relaxed);
    if sink.is_null() {
        return;
    }
    // TraceMe's metadata form: "name#k=v,k=v#" (shown as the event's args).
    let mut s = format!("rdma_device:{name}#step={step},bytes={bytes}");
    if let Some(k) = key {
        // ',' '#' and '=' would break the encoding.
        s.push_str(",key=");
        s.extend(k.chars().map(|c| if matches!(c, ',' | '#' | '=') { '_' } else { c }));
    }
    s.push('#');
    // SAFETY: the sink was attached with a function pointer of this type
    // (see `attach_tf`), and is callable from any thread.
    let f: TfSink = unsafe { std::mem::transmute::<*mut (), TfSink>(sink) };
    // SAFETY: a valid UTF-8 buffer and its length.
    unsafe { f(s.as_ptr().cast(), s.len(), start_ns, end_ns) };
}

/// Every span recorded since the last take, removed from the buffer, and
/// how many were dropped (buffer full) since.
pub fn take() -> (Vec<Span>, u64) {
    let v = std::mem::take(&mut *SPANS.lock());
    (v, DROPPED.swap(0, Ordering::Relaxed))
}

fn thread_name(tid: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).map(|s| s.trim().to_string()).unwrap_or_else(|_| format!("thread {tid}"))
}

/// `s` as a JSON string literal, appended to `out`.
fn json_str(out: &mut String, s: &str) {
    out.push_str(&crate::stats::json_str(s));
}

/// [`take`] as a JSON array of Chrome trace events of this process
/// (`pid`: this process; `process`: its name in the viewer), with a
/// `thread_name` event per thread and the dropped count in a metadata
/// event.
pub fn take_chrome_json(process: &str) -> String {
    let (spans, dropped) = take();
    let pid = std::process::id();
    let mut out = String::with_capacity(spans.len() * 160 + 256);
    out.push('[');
    let _ = write!(out, "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{pid},\"tid\":0,\"args\":{{\"name\":");
    json_str(&mut out, process);
    let _ = write!(out, ",\"rdma_device_dropped_spans\":{dropped}}}}}");
    let mut tids: Vec<i32> = spans.iter().map(|s| s.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    for t in tids {
        let _ = write!(out, ",{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{pid},\"tid\":{t},\"args\":{{\"name\":");
        json_str(&mut out, &thread_name(t));
        out.push_str("}}");
    }
    for s in &spans {
        let _ = write!(out, ",{{\"ph\":\"X\",\"cat\":\"rdma_device\",\"name\":");
        json_str(&mut out, s.name.as_str());
        let _ = write!(
            out,
            ",\"pid\":{pid},\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"step\":\"{}\",\"bytes\":{}",
            s.tid,
            s.start_ns as f64 / 1000.0,
            (s.end_ns - s.start_ns) as f64 / 1000.0,
            s.step,
            s.bytes
        );
        if let Some(k) = &s.key {
            out.push_str(",\"key\":");
            json_str(&mut out, k);
        }
        out.push_str("}}");
    }
    out.push(']');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off: nothing is recorded. On: spans come back with their fields,
    /// as valid Chrome trace JSON, and the buffer is emptied by the take.
    /// (One test: recording is process-wide.)
    #[test]
    fn records_only_while_on_and_exports_chrome_events() {
        let _ = take();
        set_enabled(false);
        let t = start();
        assert_eq!(t, 0, "nothing starts while off");
        end("write", t, 1, 2, None);
        set_enabled(true);
        let t = start();
        assert!(t > 0);
        end("write", t, 7, 4096, Some("a\"key"));
        record_external("RunGraph", now() - 1000, now(), 7, 0, None);
        let j = take_chrome_json("task \"0\"");
        set_enabled(false);
        assert!(j.contains("\"name\":\"write\"") && j.contains("\"step\":\"7\"") && j.contains("\"bytes\":4096"), "{j}");
        assert!(j.contains("\"key\":\"a\\\"key\"") && j.contains("\"name\":\"RunGraph\""), "{j}");
        assert!(j.contains("\"thread_name\"") && j.contains("task \\\"0\\\""), "{j}");
        assert_eq!(take().0.len(), 0, "the take emptied the buffer");
    }
}
