//! The arguments of an export, one line each: the macros every export of
//! the C ABI unwraps its arguments with, and the checks behind them.
//! Declared first in `ffi` (`#[macro_use]`), so every module of it has them.
//!
//! Each macro is used inside an export's `boundary` closure: it checks one
//! argument, and on a bad one returns `Err(Error::InvalidArgument(..))`
//! from that closure, the message naming the argument. Each expands to an
//! `unsafe` read whose contract is the export's own
//! (include/rdma_device.h): the macro checks what can be checked (NULL,
//! UTF-8, rank) and trusts the caller for the rest (that a pointer points
//! to what it says, for as long as said).

use std::ffi::c_char;

use super::rdev_tensor_meta;
use crate::error::Error;
use crate::rendezvous::{Dims, TensorMeta};

/// `handle!(p, "what")`: `p` (`*const T` or `*mut T`) as `&T`, or
/// "what is NULL".
///
/// SAFETY contract: a non-NULL `p` points to a live `T` (a handle the
/// library handed out and the caller has not freed) for as long as the
/// reference is used, which is the rest of the export.
macro_rules! handle {
    ($p:expr, $what:literal) => {{
        let p = $p;
        // SAFETY: a non-NULL handle is live for the call (the macro's contract).
        let r = unsafe { p.as_ref() };
        r.ok_or_else(|| $crate::error::Error::InvalidArgument(String::from(concat!($what, " is NULL"))))?
    }};
}

/// `ctx!(ctx)`: the context as `&rdev_context`, or "context is NULL".
///
/// SAFETY contract: `handle!`'s: a non-NULL `ctx` came from
/// `rdev_context_new` and is not freed during the call.
macro_rules! ctx {
    ($p:expr) => {
        handle!($p, "context")
    };
}

/// `opt_ctx!(ctx)`: `Some(&rdev_context)`, or `None` for a NULL `ctx`
/// (for the exports that take NULL to mean "no context: the environment's
/// settings").
///
/// SAFETY contract: `ctx!`'s, for a non-NULL `ctx`.
macro_rules! opt_ctx {
    ($p:expr) => {{
        let p: *const $crate::ffi::rdev_context = $p;
        // SAFETY: a non-NULL ctx is a live context (the macro's contract).
        unsafe { p.as_ref() }
    }};
}

/// `text!(p, len, "what")`: the string of `len` bytes at `p` as `&str`:
/// "" when `len` is 0 (`p` may then be NULL), "what is NULL" when `p` is
/// NULL with `len > 0`, "what is not UTF-8" when it is not.
///
/// SAFETY contract: a non-NULL `p` has `len` readable bytes, unchanged
/// while the export runs.
macro_rules! text {
    ($p:expr, $len:expr, $what:literal) => {{
        let (p, len) = ($p, $len);
        // SAFETY: `len` readable bytes at a non-NULL `p` (the macro's contract).
        let r = unsafe { $crate::ffi::args::str_arg(p, len, $what) };
        r?
    }};
}

/// `bytes!(p, len, "what")`: the `len` bytes at `p` as `&[u8]`: empty when
/// `len` is 0 (`p` may then be NULL), "what is NULL" when `p` is NULL with
/// `len > 0`.
///
/// SAFETY contract: a non-NULL `p` has `len` readable bytes, unchanged for
/// as long as the slice is used (the export says how long: the call, or
/// until its completion).
macro_rules! bytes {
    ($p:expr, $len:expr, $what:literal) => {{
        let (p, len): (*const u8, usize) = ($p, $len);
        // SAFETY: `len` readable bytes at a non-NULL `p` (the macro's contract).
        let r = unsafe { $crate::ffi::args::bytes_arg(p, len, $what) };
        r?
    }};
}

/// `meta!(meta)`: the tensor's `rdev_tensor_meta` as a `TensorMeta`, or
/// "meta is NULL", "meta.dims is NULL" (with `ndims > 0`), or
/// "N dimensions (TensorFlow allows 254)".
///
/// SAFETY contract: a non-NULL `meta` points to a valid struct whose
/// `dims` has `ndims` readable entries during the call.
macro_rules! meta {
    ($p:expr) => {{
        let p = $p;
        // SAFETY: a valid struct at a non-NULL `meta` (the macro's contract).
        let r = unsafe { $crate::ffi::args::meta_arg(p) };
        r?
    }};
}

/// `out!(p)`: the out-parameter `p` (`*mut T`) as `&mut MaybeUninit<T>`,
/// to `write` once the call has succeeded, or "p is NULL" (named after the
/// parameter).
///
/// SAFETY contract: a non-NULL `p` points to writable room for a `T`
/// (initialized or not), that nothing else touches during the call.
macro_rules! out {
    ($p:ident) => {{
        let p = $p;
        if p.is_null() {
            return Err($crate::error::Error::InvalidArgument(String::from(concat!(stringify!($p), " is NULL"))));
        }
        // SAFETY: non-NULL, room for a T (the macro's contract).
        unsafe { $crate::ffi::args::uninit_mut(p) }
    }};
}

/// `opt_out!(p)`: an out-parameter the caller may leave NULL: `None` then
/// (the value is not wanted), else `out!`'s `&mut MaybeUninit<T>`.
///
/// SAFETY contract: `out!`'s, for a non-NULL `p`.
macro_rules! opt_out {
    ($p:ident) => {{
        let p = $p;
        // SAFETY: room for a T at a non-NULL `p` (the macro's contract).
        (!p.is_null()).then(|| unsafe { $crate::ffi::args::uninit_mut(p) })
    }};
}

/// `callback!(cb, "what")`: a callback the export needs, or "what is NULL".
/// No unsafe here: calling it later is where the caller's contract (a
/// function callable from the threads the export names, with its user
/// data) comes in.
macro_rules! callback {
    ($cb:expr, $what:literal) => {
        match $cb {
            Some(f) => f,
            None => return Err($crate::error::Error::InvalidArgument(String::from(concat!($what, " is NULL")))),
        }
    };
}

/// `bytes!`'s check: the `len` bytes at `p` (none when `len` is 0, where
/// `p` may be NULL).
///
/// # Safety
/// A non-NULL `p` has `len` readable bytes, unchanged while the result is used.
pub(super) unsafe fn bytes_arg<'a>(p: *const u8, len: usize, what: &str) -> Result<&'a [u8], Error> {
    if p.is_null() && len > 0 {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: the caller passes `len` readable bytes at `p`.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// `text!`'s check: `bytes_arg`'s, and UTF-8.
///
/// # Safety
/// As `bytes_arg`.
pub(super) unsafe fn str_arg<'a>(p: *const c_char, len: usize, what: &str) -> Result<&'a str, Error> {
    // SAFETY: the caller's contract, passed on.
    let b = unsafe { bytes_arg(p.cast::<u8>(), len, what) }?;
    std::str::from_utf8(b).map_err(|_| Error::InvalidArgument(format!("{what} is not UTF-8")))
}

/// `out!`'s view of an out-parameter: room for a `T`, initialized or not.
///
/// # Safety
/// `p` is non-NULL and points to writable room for a `T` that nothing else
/// touches while the result is used.
pub(super) unsafe fn uninit_mut<'a, T>(p: *mut T) -> &'a mut std::mem::MaybeUninit<T> {
    // SAFETY: per the function contract; MaybeUninit<T> has T's layout.
    unsafe { &mut *p.cast::<std::mem::MaybeUninit<T>>() }
}

/// `meta!`'s check: the tensor's meta, its rank and dims.
///
/// # Safety
/// A non-NULL `meta` points to a valid struct with `ndims` readable
/// entries at `dims`.
pub(super) unsafe fn meta_arg(meta: *const rdev_tensor_meta) -> Result<TensorMeta, Error> {
    let m = handle!(meta, "meta");
    if m.ndims > 254 {
        return Err(Error::InvalidArgument(format!("{} dimensions (TensorFlow allows 254)", m.ndims)));
    }
    let dims = if m.ndims == 0 {
        Dims::new()
    } else if m.dims.is_null() {
        return Err(Error::InvalidArgument("meta.dims is NULL".into()));
    } else {
        // SAFETY: ndims entries are readable at dims.
        Dims::from_slice(unsafe { std::slice::from_raw_parts(m.dims, m.ndims as usize) })
    };
    Ok(TensorMeta { dtype: m.dtype, flags: m.flags, dims })
}
