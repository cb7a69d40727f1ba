//! What the library tells about itself: counters, settings, status names,
//! the last error, the version; and the fallback counter the shim feeds.

use std::ffi::c_char;

use super::{boundary, status, LAST_ERROR};
use crate::config::Config;
use crate::error::Error;
use crate::stats::Stats;
use status::rdev_status;

/// Count a tensor of `bytes` that went over stock gRPC, with its reason.
#[no_mangle]
pub unsafe extern "C" fn rdev_record_fallback(bytes: u64, reason: *const c_char, reason_len: usize) -> rdev_status {
    boundary(|| {
        let r = text!(reason, reason_len, "reason");
        Stats::global().record_fallback(bytes, r);
        Ok(())
    })
}

unsafe fn write_out(s: &str, buf: *mut c_char, cap: usize, out_len: *mut usize) -> Result<(), Error> {
    if let Some(out_len) = opt_out!(out_len) {
        out_len.write(s.len());
    }
    if buf.is_null() || cap < s.len() + 1 {
        return Err(Error::ResourceExhausted(format!("buffer of {cap} bytes; {} needed", s.len() + 1)));
    }
    // SAFETY: cap >= len + 1 bytes are writable at buf.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

/// Process-wide counters as JSON, NUL-terminated into `buf` (`cap` bytes).
/// `*out_len` gets the JSON length; RDEV_RESOURCE_EXHAUSTED when `cap` is
/// too small (call again with `*out_len + 1`).
#[no_mangle]
pub unsafe extern "C" fn rdev_stats_json(buf: *mut c_char, cap: usize, out_len: *mut usize) -> rdev_status {
    // SAFETY: arguments per contract.
    boundary(|| unsafe { write_out(&Stats::global().to_json(), buf, cap, out_len) })
}

/// Zero the process-wide counters.
#[no_mangle]
pub extern "C" fn rdev_stats_reset() {
    let _ = boundary(|| {
        Stats::global().reset();
        Ok(())
    });
}

/// Effective settings (from the environment now) with defaults and help,
/// as JSON; same buffer rules as `rdev_stats_json`. A bad value yields
/// RDEV_CONFIG with the reason in `rdev_last_error`.
#[no_mangle]
pub unsafe extern "C" fn rdev_config_json(buf: *mut c_char, cap: usize, out_len: *mut usize) -> rdev_status {
    boundary(|| {
        let cfg = Config::from_env()?;
        // SAFETY: arguments per contract.
        unsafe { write_out(&cfg.to_json(), buf, cap, out_len) }
    })
}

/// A static, NUL-terminated name for `status`.
#[no_mangle]
pub extern "C" fn rdev_status_str(status: rdev_status) -> *const c_char {
    status::name(status).as_ptr()
}

/// The message of the last failed call on this thread, NUL-terminated into
/// `buf` (truncated to `cap - 1` bytes). Returns the full length.
#[no_mangle]
pub unsafe extern "C" fn rdev_last_error(buf: *mut c_char, cap: usize) -> usize {
    LAST_ERROR.with(|l| {
        let s = l.borrow();
        if !buf.is_null() && cap > 0 {
            let n = s.len().min(cap - 1);
            // SAFETY: cap bytes are writable at buf.
            unsafe {
                std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        s.len()
    })
}

/// The library version, NUL-terminated, static.
#[no_mangle]
pub extern "C" fn rdev_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
