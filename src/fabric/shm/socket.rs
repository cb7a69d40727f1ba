//! Bootstrap sockets for the shm backend: framed messages over a unix
//! stream socket, with file descriptors passed by SCM_RIGHTS, and the
//! peer-credential check.
//!
//! Frame: `u32 length (LE, of kind + body) | u8 kind | body`. A frame longer
//! than the limit is a protocol error, never an allocation.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::constants::{CONTROL_SEND_TIMEOUT_MS, MAX_MSG_BYTES};
use crate::error::{Error, Result};

pub const KIND_HELLO: u8 = 1;
pub const KIND_ACCEPT: u8 = 2;
pub const KIND_REFUSE: u8 = 3;
pub const KIND_MSG: u8 = 4;
/// The listener's first frame on a connection: its nonce for the hello.
pub const KIND_CHALLENGE: u8 = 5;

/// Largest frame body: a control message plus a little framing.
pub const MAX_FRAME: usize = MAX_MSG_BYTES + 64;

/// The abstract-namespace socket name for the task listening on `addr`
/// ("host:port"). Keyed by uid and port: ports are unique per host, and
/// two users never see each other's sockets by accident.
pub fn socket_name(addr: &str) -> Result<Vec<u8>> {
    let port = addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| Error::InvalidArgument(format!("address {addr:?} is not host:port")))?;
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    Ok(format!("rdma_device.{uid}.{port}").into_bytes())
}

fn sockaddr(name: &[u8]) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > sa.sun_path.len() {
        return Err(Error::InvalidArgument("socket name too long".into()));
    }
    // Abstract namespace: sun_path[0] = 0, then the name (no terminator).
    for (i, b) in name.iter().enumerate() {
        sa.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((sa, len as libc::socklen_t))
}

fn new_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::last_os("socket(AF_UNIX)"));
    }
    // SAFETY: fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Bind and listen on the abstract socket `name`.
pub fn listen(name: &[u8]) -> Result<OwnedFd> {
    let fd = new_socket()?;
    let (sa, len) = sockaddr(name)?;
    // SAFETY: sa/len describe a valid sockaddr_un.
    if unsafe { libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::Io(format!(
            "bind shm bootstrap socket {:?}: {e} (is another task already serving this port?)",
            String::from_utf8_lossy(name)
        )));
    }
    // SAFETY: valid bound socket.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
        return Err(Error::last_os("listen on shm bootstrap socket"));
    }
    Ok(fd)
}

/// Connect to the abstract socket `name`; `Err(NotViable)` when nobody
/// listens there (yet), so callers can retry until their deadline.
pub fn connect(name: &[u8]) -> Result<UnixStream> {
    let fd = new_socket()?;
    let (sa, len) = sockaddr(name)?;
    // SAFETY: sa/len describe a valid sockaddr_un.
    if unsafe { libc::connect(fd.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::NotViable(format!(
            "no shm listener at {:?}: {e}",
            String::from_utf8_lossy(name)
        )));
    }
    control_socket(UnixStream::from(fd), Duration::from_millis(CONTROL_SEND_TIMEOUT_MS))
}

/// A connection's socket as both ends use it: a send that waits longer
/// than `send_timeout` for the peer to read fails (see `send_all`).
pub fn control_socket(s: UnixStream, send_timeout: Duration) -> Result<UnixStream> {
    s.set_write_timeout(Some(send_timeout)).map_err(|e| Error::Io(format!("SO_SNDTIMEO on an shm socket: {e}")))?;
    Ok(s)
}

/// Accept one connection (blocking).
pub fn accept(listener: &OwnedFd) -> Result<UnixStream> {
    // SAFETY: valid listening socket; we do not need the peer address.
    let fd = unsafe {
        libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
    };
    if fd < 0 {
        return Err(Error::last_os("accept on shm bootstrap socket"));
    }
    // SAFETY: fresh fd we own.
    control_socket(UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) }), Duration::from_millis(CONTROL_SEND_TIMEOUT_MS))
}

/// The uid of the process at the other end.
pub fn peer_uid(s: &UnixStream) -> Result<u32> {
    peer_cred(s).map(|c| c.0)
}

/// The (uid, pid) of the process at the other end, as of its connect.
pub fn peer_cred(s: &UnixStream) -> Result<(u32, i32)> {
    // SAFETY: ucred is POD; getsockopt writes at most `len` bytes into it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::last_os("SO_PEERCRED"));
    }
    Ok((cred.uid, cred.pid))
}

/// Bodies up to this size are sent from a stack buffer.
const SMALL_FRAME: usize = 256;

/// Send one frame, with `fds` attached to its first byte.
pub fn send_frame(s: &UnixStream, kind: u8, body: &[u8], fds: &[i32]) -> Result<()> {
    if body.len() > MAX_FRAME {
        return Err(Error::InvalidArgument(format!("message of {} bytes exceeds {MAX_FRAME}", body.len())));
    }
    let mut head = [0u8; 5];
    head[..4].copy_from_slice(&((body.len() + 1) as u32).to_le_bytes());
    head[4] = kind;
    if fds.is_empty() && body.len() <= SMALL_FRAME {
        // The usual control message: one write from the stack.
        let mut buf = [0u8; 5 + SMALL_FRAME];
        buf[..5].copy_from_slice(&head);
        buf[5..5 + body.len()].copy_from_slice(body);
        return send_all(s, &buf[..5 + body.len()]);
    }
    if fds.is_empty() {
        let mut buf = Vec::with_capacity(5 + body.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(body);
        return send_all(s, &buf);
    }
    // Header (with the fds) via sendmsg, then the body.
    let mut iov = libc::iovec { iov_base: head.as_ptr() as *mut _, iov_len: head.len() };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is POD; we fill the fields that sendmsg reads.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer is CMSG_SPACE(fd_bytes) long, so the first
    // header and its data fit; fds are copied into its data area.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), fd_bytes);
    }
    // SAFETY: msg points to live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n != head.len() as isize {
        return Err(Error::last_os("sendmsg with descriptors"));
    }
    send_all(s, body)
}

/// Write all of `b` with MSG_NOSIGNAL: a dead peer must be an error, never
/// a SIGPIPE that kills the host process (TensorFlow or a C program).
fn send_all(s: &UnixStream, mut b: &[u8]) -> Result<()> {
    while !b.is_empty() {
        // SAFETY: b is a live slice; the fd is valid for the call.
        let n = unsafe { libc::send(s.as_raw_fd(), b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                // Part of a frame may be out: the connection cannot go on.
                let t = s.write_timeout().ok().flatten().unwrap_or_default();
                return Err(Error::PeerLost(format!(
                    "the peer read nothing from its shm control socket for {} ms (stopped, or not draining it)",
                    t.as_millis()
                )));
            }
            return Err(Error::PeerLost(format!("shm socket write: {e}")));
        }
        b = &b[n as usize..];
    }
    Ok(())
}

/// Receive one frame: (kind, body, received fds). EOF → `PeerLost`.
pub fn recv_frame(s: &UnixStream) -> Result<(u8, Vec<u8>, Vec<OwnedFd>)> {
    let mut body = Vec::new();
    let (kind, fds) = recv_frame_into(s, &mut body)?;
    Ok((kind, body, fds))
}

/// `recv_frame` into `body` (cleared first), whose capacity a reader keeps
/// from frame to frame: a steady stream of messages allocates nothing.
pub fn recv_frame_into(s: &UnixStream, body: &mut Vec<u8>) -> Result<(u8, Vec<OwnedFd>)> {
    let mut head = [0u8; 5];
    let mut iov = libc::iovec { iov_base: head.as_mut_ptr().cast(), iov_len: head.len() };
    // SAFETY: pure computation.
    let space = unsafe { libc::CMSG_SPACE((4 * std::mem::size_of::<i32>()) as u32) } as usize;
    // Aligned for cmsghdr; CMSG_SPACE(16) is 32 bytes on Linux.
    let mut cbuf = [0u64; 8];
    if space > std::mem::size_of_val(&cbuf) {
        return Err(Error::Internal(format!("control buffer of {space} bytes needed")));
    }
    // SAFETY: POD.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: buffers live for the call.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            // A read timeout (set during handshakes): nothing came in time.
            return Err(Error::Timeout("no answer on the shm socket in time".into()));
        }
        return Err(Error::PeerLost(format!("shm socket read: {e}")));
    }
    if n == 0 {
        return Err(Error::PeerLost("peer closed the connection".into()));
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<i32>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<i32>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let mut r = s;
    let got = n as usize;
    if got < head.len() {
        r.read_exact(&mut head[got..]).map_err(|e| Error::PeerLost(format!("shm socket read: {e}")))?;
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len == 0 || len - 1 > MAX_FRAME {
        return Err(Error::Protocol(format!("frame length {len} out of range (max {MAX_FRAME})")));
    }
    body.clear();
    body.try_reserve(len - 1).map_err(|_| Error::ResourceExhausted(format!("a frame of {len} bytes")))?;
    body.resize(len - 1, 0);
    r.read_exact(body).map_err(|e| Error::PeerLost(format!("shm socket read (truncated frame): {e}")))?;
    Ok((head[4], fds))
}

/// A pidfd for `pid` (readable once the process has exited), or None where
/// the kernel has no pidfd_open (before 5.3).
pub fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: a plain system call; the result is a new fd we own or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fresh fd we own.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Has the process behind `pidfd` exited? (Never blocks.)
pub fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd on the stack, zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18, N5: a peer that reads nothing (SIGSTOP, swapped out) makes
    /// a control send fail after the send timeout, with the reason, instead
    /// of blocking the sending thread forever.
    #[test]
    fn a_send_to_a_peer_that_reads_nothing_fails_after_its_timeout() {
        let (a, _b) = UnixStream::pair().unwrap();
        let a = control_socket(a, Duration::from_millis(300)).unwrap();
        let body = vec![7u8; 60_000];
        let t0 = std::time::Instant::now();
        let mut sent = 0usize;
        let err = loop {
            match send_frame(&a, KIND_MSG, &body, &[]) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "sends to a peer that reads nothing never failed ({sent} sent)");
        };
        assert!(sent > 0, "the socket took no frame at all");
        assert!(t0.elapsed() < Duration::from_secs(5), "failed only after {:?}", t0.elapsed());
        assert!(matches!(err, Error::PeerLost(_)) && err.to_string().contains("read nothing"), "{err}");
    }

    /// Both ends of a connection carry the send timeout.
    #[test]
    fn both_ends_of_a_connection_have_a_send_timeout() {
        let name = format!("rdma_device-test-sndtimeo-{}", std::process::id()).into_bytes();
        let l = listen(&name).unwrap();
        let c = connect(&name).unwrap();
        let a = accept(&l).unwrap();
        let want = Some(Duration::from_millis(CONTROL_SEND_TIMEOUT_MS));
        assert_eq!(c.write_timeout().unwrap(), want, "connecting end");
        assert_eq!(a.write_timeout().unwrap(), want, "accepting end");
    }
}
