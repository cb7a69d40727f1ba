//! `shm`: the remote-memory device for tasks on one host.
//!
//! A connecting sender receives a window on the receiver's arena (a memfd
//! of its own whose pages the receiver maps at the slots placed for that
//! sender, see `fabric/arena.rs`), a doorbell ring and an eventfd, over a
//! unix socket named after the task's port, checked to belong to the same
//! uid in both directions, and maps the window. A one-sided write is then
//! one memcpy into the receiver's pages followed by a doorbell entry: the
//! receiver's CPU does nothing until it polls the ring, exactly the
//! semantics of an RDMA WRITE with immediate; and, as with a memory region
//! per sender, it can only change what the receiver reads in its own slots.

mod copy;
mod endpoint;
mod listener;
mod outbox;
pub(crate) mod ring;
#[doc(hidden)]
pub mod socket;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use endpoint::ShmEndpoint;
pub use listener::ShmListener;

use crate::error::{Error, Result};
use crate::fabric::{Arena, Endpoint, Fabric, FabricEvents, Listener, TransportKind};

pub struct ShmFabric {
    spin: Duration,
    copy_threads: usize,
}

impl ShmFabric {
    /// `spin`: how long the progress thread polls before it sleeps.
    pub fn new(spin: Duration) -> ShmFabric {
        ShmFabric { spin, copy_threads: 1 }
    }

    /// Copy large writes with `threads` threads (the caller included).
    pub fn with_copy_threads(mut self, threads: usize) -> ShmFabric {
        self.copy_threads = threads.max(1);
        self
    }
}

impl Fabric for ShmFabric {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn is_viable(&self) -> Result<()> {
        // memfd + abstract unix sockets are all we need; probe memfd.
        Arena::new("rdma_device-probe", 4096)
            .map(|_| ())
            .map_err(|e| Error::NotViable(format!("shared memory unavailable: {e}")))
    }

    fn reaches(&self, remote: &str) -> Result<()> {
        let host = host_of(remote)?;
        if is_local_host(&host) {
            Ok(())
        } else {
            Err(Error::NotViable(format!("{remote} is not on this host")))
        }
    }

    fn listen(&self, local: &str, arena: Arc<Arena>, events: Arc<dyn FabricEvents>) -> Result<Arc<dyn Listener>> {
        Ok(ShmListener::start(local, arena, events, self.spin)?)
    }

    fn connect(
        &self,
        remote: &str,
        hello: &[u8],
        events: Arc<dyn FabricEvents>,
        timeout: Duration,
        wait_for_listener: bool,
    ) -> Result<Arc<dyn Endpoint>> {
        let name = socket::socket_name(remote)?;
        let deadline = Instant::now() + timeout;
        // A receiver that may be (re)starting: retry "nobody listens" until
        // the deadline; every other error is final. A listener that closes
        // the connection before answering (a task dying or shutting down
        // between our connect and its accept) counts as nobody listening.
        // One that says it is closing runs this transport: a lost peer,
        // never NotViable.
        loop {
            let nobody = match socket::connect(&name) {
                Ok(stream) => match self.handshake(stream, remote, hello, events.clone(), deadline) {
                    Ok(ep) => return Ok(ep),
                    Err(Error::PeerLost(m)) if m.contains(crate::fabric::LISTENER_CLOSING) && !wait_for_listener => {
                        return Err(Error::PeerLost(m));
                    }
                    Err(Error::PeerLost(m)) => m,
                    Err(e) => return Err(e),
                },
                Err(Error::NotViable(m)) => m,
                Err(e) => return Err(e),
            };
            if !wait_for_listener {
                return Err(Error::NotViable(format!("no shm listener for {remote} (it does not run this transport): {nobody}")));
            }
            if Instant::now() < deadline {
                log::debug!("{nobody}; retrying");
                std::thread::sleep(Duration::from_millis(10));
            } else if timeout.is_zero() {
                return Err(Error::PeerLost(format!("{remote} is not accepting connections: {nobody}")));
            } else {
                return Err(Error::Timeout(format!("connecting to {remote} over shm for {timeout:?}: {nobody}")));
            }
        }
    }
}

impl ShmFabric {
    /// Check the listener's owner and trade hellos on a fresh connection.
    /// `Error::PeerLost`: the listener closed it before answering.
    fn handshake(
        &self,
        stream: std::os::unix::net::UnixStream,
        remote: &str,
        hello: &[u8],
        events: Arc<dyn FabricEvents>,
        deadline: Instant,
    ) -> Result<Arc<dyn Endpoint>> {
        // The name is abstract: any local user can bind it first. Talk only
        // to a listener of our own uid (the listener checks us likewise).
        let uid = socket::peer_uid(&stream)?;
        // SAFETY: getuid has no preconditions.
        let me = unsafe { libc::getuid() };
        if uid != me {
            return Err(Error::NotViable(format!(
                "the shm listener for {remote} belongs to uid {uid}, not ours ({me}): refusing to connect"
            )));
        }
        let pool = copy::CopyPool::get(self.copy_threads);
        Ok(ShmEndpoint::handshake(stream, remote, hello, events, deadline, pool)?)
    }
}

/// The host part of "host:port" or "[v6]:port".
pub fn host_of(addr: &str) -> Result<String> {
    let (h, _) = addr
        .rsplit_once(':')
        .ok_or_else(|| Error::InvalidArgument(format!("address {addr:?} is not host:port")))?;
    Ok(h.trim_start_matches('[').trim_end_matches(']').to_string())
}

/// Does `host` name this machine (loopback, our hostname, or an address of
/// one of our interfaces)?
pub fn is_local_host(host: &str) -> bool {
    use std::net::{IpAddr, ToSocketAddrs};
    if host.eq_ignore_ascii_case("localhost") || host == hostname() {
        return true;
    }
    let ips: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => match (host, 0u16).to_socket_addrs() {
            Ok(it) => it.map(|a| a.ip()).collect(),
            Err(_) => return false,
        },
    };
    let mine = local_ips();
    ips.iter().any(|ip| ip.is_loopback() || ip.is_unspecified() || mine.contains(ip))
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return String::new();
    }
    let n = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn local_ips() -> Vec<std::net::IpAddr> {
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return out;
    }
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: p walks the list getifaddrs returned; addresses are read
        // according to their family.
        unsafe {
            let a = (*p).ifa_addr;
            if !a.is_null() {
                match (*a).sa_family as i32 {
                    libc::AF_INET => {
                        let sin = &*(a as *const libc::sockaddr_in);
                        out.push(std::net::IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(a as *const libc::sockaddr_in6);
                        out.push(std::net::IpAddr::from(sin6.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
            p = (*p).ifa_next;
        }
    }
    // SAFETY: the list from getifaddrs.
    unsafe { libc::freeifaddrs(ifa) };
    out
}
