//! The per-transfer timeline (see `crate::trace`): switch recording on and
//! off, take what was recorded as Chrome trace events, record the shim's
//! own spans, and attach TensorFlow's profiler.

use std::ffi::{c_char, CString};
use std::sync::atomic::AtomicI32;

use super::{boundary, status};
use crate::error::Error;
use crate::trace;
use status::rdev_status;

/// Record every transfer's spans into this process's buffer (`on`), or
/// stop. Recording is process-wide; `RDMA_DEVICE_TRACE=1` turns it on when
/// a context is created.
#[no_mangle]
pub extern "C" fn rdev_trace_enable(on: bool) {
    trace::set_enabled(on);
}

/// Whether a span recorded now would go anywhere (this process's buffer
/// or TensorFlow's profiler): the shim skips its clock reads otherwise.
#[no_mangle]
pub extern "C" fn rdev_trace_active() -> bool {
    trace::active()
}

/// Now, in the trace's clock (CLOCK_REALTIME, ns: TensorFlow's profiler's).
#[no_mangle]
pub extern "C" fn rdev_trace_now() -> i64 {
    trace::now()
}

/// Record a span the caller measured: `name` (`name_len` bytes) from
/// `start_ns` to `end_ns` (`rdev_trace_now`), for step `step`, moving
/// `bytes`, about `key` (may be NULL). Dropped when nothing records.
#[no_mangle]
pub unsafe extern "C" fn rdev_trace_span(
    name: *const c_char,
    name_len: usize,
    start_ns: i64,
    end_ns: i64,
    step_id: u64,
    bytes: u64,
    key: *const c_char,
    key_len: usize,
) -> rdev_status {
    boundary(|| {
        let name = text!(name, name_len, "name");
        let key = if key.is_null() { None } else { Some(text!(key, key_len, "key")) };
        trace::record_external(name, start_ns, end_ns, step_id, bytes, key);
        Ok(())
    })
}

/// Take (and clear) every span recorded so far, as a JSON array of Chrome
/// trace events of this process, named `process` in the viewer.
/// `*out_json` gets a NUL-terminated string to free with
/// `rdev_string_free`, `*out_len` its length.
#[no_mangle]
pub unsafe extern "C" fn rdev_trace_take_json(process: *const c_char, process_len: usize, out_json: *mut *mut c_char, out_len: *mut usize) -> rdev_status {
    boundary(|| {
        let process = text!(process, process_len, "process");
        let out_json = out!(out_json);
        let out_len = opt_out!(out_len);
        let json = trace::take_chrome_json(process);
        let len = json.len();
        let c = CString::new(json).map_err(|_| Error::Internal("trace JSON holds a NUL".into()))?;
        out_json.write(c.into_raw());
        if let Some(out_len) = out_len {
            out_len.write(len);
        }
        Ok(())
    })
}

/// Free a string this library returned (NULL: nothing).
#[no_mangle]
pub unsafe extern "C" fn rdev_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: `s` came from CString::into_raw in this library.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// Records one span into TensorFlow's profiler on the calling thread:
/// `name` (`name_len` bytes, TraceMe's `name#k=v,...#` form, valid during
/// the call), start and end in `rdev_trace_now`'s clock.
#[allow(non_camel_case_types)]
pub type rdev_trace_sink_cb = Option<unsafe extern "C" fn(name: *const c_char, name_len: usize, start_ns: i64, end_ns: i64)>;

/// Called by the shim once: TensorFlow profiler's trace level (an
/// `std::atomic<int>` that lives as long as the process) and a sink that
/// records one span into TensorFlow's profiler on the calling thread (any
/// thread, progress threads included: it must not block). While the level
/// is >= 1 every span also goes there.
#[no_mangle]
pub unsafe extern "C" fn rdev_trace_attach_tf(level: *const i32, sink: rdev_trace_sink_cb) -> rdev_status {
    boundary(|| {
        let sink = callback!(sink, "sink");
        if level.is_null() {
            return Err(Error::InvalidArgument("level is NULL".into()));
        }
        // SAFETY: per the contract: a process-lifetime atomic int (same
        // layout as AtomicI32), and a sink callable from any thread.
        unsafe { trace::attach_tf(level.cast::<AtomicI32>(), sink) };
        Ok(())
    })
}
