//! Accessors of a received buffer (`rdev_buffer`), and its release.

use super::{boundary, rdev_buffer, BUFFERS};
use crate::node::Lease;

/// The lease of a buffer handed out by a recv callback.
unsafe fn lease<'a>(buf: *const rdev_buffer) -> Option<&'a Lease> {
    // SAFETY: buf is NULL or a live buffer (the caller's contract).
    unsafe { buf.as_ref() }.and_then(|b| b.lease.as_ref())
}

/// Payload bytes (64-byte aligned; NULL when empty).
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_data(buf: *const rdev_buffer) -> *const u8 {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.map_or(std::ptr::null(), |l| if l.is_empty() { std::ptr::null() } else { l.as_ptr() })
}

/// Payload length in bytes.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_len(buf: *const rdev_buffer) -> usize {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.map_or(0, |l| l.len())
}

/// dtype as sent.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_dtype(buf: *const rdev_buffer) -> u32 {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.map_or(0, |l| l.meta().dtype)
}

/// Flags as sent (RDEV_FLAG_*).
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_flags(buf: *const rdev_buffer) -> u32 {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.map_or(0, |l| l.meta().flags)
}

/// Number of dimensions.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_ndims(buf: *const rdev_buffer) -> u32 {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.map_or(0, |l| l.meta().dims.len() as u32)
}

/// Pointer to `rdev_buffer_ndims` dimensions, valid until release.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_dims(buf: *const rdev_buffer) -> *const i64 {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.map_or(std::ptr::null(), |l| l.meta().dims.as_ptr())
}

/// true when the bytes sit in the receive arena (written there by the
/// sender, zero-copy), false when they came through the chunked path.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_in_place(buf: *const rdev_buffer) -> bool {
    // SAFETY: buf per contract.
    unsafe { lease(buf) }.is_some_and(|l| l.in_place())
}

/// Everything the accessors above say about a buffer, in one call (a
/// binding that pays per call, such as Python's ctypes, reads one struct
/// instead of seven calls).
#[repr(C)]
pub struct rdev_buffer_desc {
    /// As `rdev_buffer_data`.
    pub data: *const u8,
    /// As `rdev_buffer_len`.
    pub len: usize,
    /// As `rdev_buffer_dims`: `ndims` dimensions, valid until release.
    pub dims: *const i64,
    pub dtype: u32,
    pub flags: u32,
    pub ndims: u32,
    /// As `rdev_buffer_in_place`.
    pub in_place: bool,
}

/// Fill `out` with what the accessors say of `buf`; false (and `out`
/// untouched) when `buf` or `out` is NULL or `buf` was released.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_describe(buf: *const rdev_buffer, out: *mut rdev_buffer_desc) -> bool {
    // SAFETY: buf per contract.
    let Some(l) = (unsafe { lease(buf) }) else { return false };
    if out.is_null() {
        return false;
    }
    let m = l.meta();
    let d = rdev_buffer_desc {
        data: if l.is_empty() { std::ptr::null() } else { l.as_ptr() },
        len: l.len(),
        dims: m.dims.as_ptr(),
        dtype: m.dtype,
        flags: m.flags,
        ndims: m.dims.len() as u32,
        in_place: l.in_place(),
    };
    // SAFETY: out checked non-NULL; the caller's writable struct.
    unsafe { out.write(d) };
    true
}

/// Release a buffer: its slot goes back to the sender. NULL is a no-op.
/// Release each buffer once: a second release of a buffer that was not
/// handed out again is refused with an error in the log (it would
/// otherwise give one buffer two owners); after that it is undefined, as a
/// second `free` is.
#[no_mangle]
pub unsafe extern "C" fn rdev_buffer_release(buf: *mut rdev_buffer) {
    let _ = boundary(|| {
        if !buf.is_null() {
            // SAFETY: buf came from a recv callback (per contract; a box
            // released already waits in BUFFERS, checked below).
            let mut b = unsafe { Box::from_raw(buf) };
            let Some(lease) = b.lease.take() else {
                // Released already: the box is BUFFERS', not ours.
                std::mem::forget(b);
                log::error!("rdev_buffer_release: buffer {buf:p} was released already; the second release is ignored");
                return Ok(());
            };
            drop(lease);
            BUFFERS.recycle(b);
        }
        Ok(())
    });
}

