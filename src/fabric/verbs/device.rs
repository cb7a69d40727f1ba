//! Devices: discovery and viability, the memlock limit, and the base verbs
//! objects (context, protection domain, completion channel, completion
//! queues) as RAII wrappers that hold their parent. What an opened device's
//! connections share on top of these (receive queue, send CQs, the
//! registrations) is `hca`, one layer up: this file imports no other
//! module of the backend.
//!
//! Which device, port and GID a connection uses is decided by rdma_cm from
//! the task's IP address (the device and port carrying that address, the GID
//! holding it, RoCE v2 when the kernel's rdma_cm default says so): the rule
//! "the GID on the interface carrying the task's address" by construction,
//! and no chance of the classic wrong-GID "retry exceeded" hang. The
//! overrides ([`super::VerbsOptions`]) restrict and check that choice;
//! [`probe`] lists what exists so errors and logs can name it.

use std::ffi::CStr;
use std::sync::Arc;

use rdma_sys::*;

use crate::error::{Error, Result};

/// One GID table entry, as the kernel describes it in sysfs.
#[derive(Debug, Clone)]
pub struct GidInfo {
    pub index: u32,
    pub gid: [u8; 16],
    /// "RoCE v2", "RoCE v1" or "IB" (from sysfs; empty when unknown).
    pub kind: String,
    /// The network interface the GID belongs to (RoCE), if known.
    pub netdev: String,
}

impl GidInfo {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        let g = &self.gid;
        if g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff {
            Some(std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
        } else {
            None
        }
    }
}

#[derive(Debug, Clone)]
pub struct PortInfo {
    pub num: u8,
    pub active: bool,
    pub state: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// "Ethernet" (RoCE) or "InfiniBand".
    pub link_layer: &'static str,
    pub gids: Vec<GidInfo>,
}

#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub name: String,
    pub max_mr_size: u64,
    pub max_mr: i32,
    pub max_qp_wr: i32,
    pub max_cqe: i32,
    pub max_qp_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
    pub max_srq_wr: i32,
    /// Scatter/gather entries per work request.
    pub max_sge: i32,
    /// Memory windows the device can hold (0: none).
    pub max_mw: i32,
    /// Type-2 memory windows (2A or 2B): what isolates verbs senders
    /// (see `mw`).
    pub mw_type2: bool,
    pub ports: Vec<PortInfo>,
}

impl DeviceInfo {
    /// "rxe0 port 1 ACTIVE mtu 1024 Ethernet, GID[1] ::ffff:10.0.2.15 RoCE v2 eth0, ..."
    pub fn describe(&self) -> String {
        let mut s = self.name.clone();
        for p in &self.ports {
            s += &format!(" port {} {} mtu {} {}", p.num, p.state, p.mtu, p.link_layer);
            for g in &p.gids {
                s += &format!(", GID[{}] {} {} {}", g.index, gid_str(&g.gid), g.kind, g.netdev);
            }
        }
        s
    }
}

/// Text form of a GID (IPv4-mapped ones in dotted form, like `ibv_devinfo`).
pub fn gid_str(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

pub fn mtu_bytes(m: ibv_mtu::Type) -> u32 {
    match m {
        ibv_mtu::IBV_MTU_256 => 256,
        ibv_mtu::IBV_MTU_512 => 512,
        ibv_mtu::IBV_MTU_1024 => 1024,
        ibv_mtu::IBV_MTU_2048 => 2048,
        ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 0,
    }
}

fn cstr(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libibverbs returns NUL-terminated strings that live as long as
    // the device list / library; we copy immediately.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn sysfs(dev: &str, port: u8, what: &str, idx: u32) -> String {
    let p = format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/{what}/{idx}");
    std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Query one opened context: device limits, ports and non-zero GIDs.
///
/// # Safety
/// `ctx` must be a valid, open `ibv_context`.
pub unsafe fn query_context(ctx: *mut ibv_context) -> Result<DeviceInfo> {
    // SAFETY: ctx is valid (caller contract); device is set by libibverbs.
    let name = cstr(unsafe { ibv_get_device_name((*ctx).device) });
    // SAFETY: zeroed POD out-struct.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx valid; attr is a writable out-struct.
    if unsafe { ibv_query_device(ctx, &mut attr) } != 0 {
        return Err(Error::last_os(&format!("ibv_query_device({name})")));
    }
    let mut ports = Vec::new();
    for num in 1..=attr.phys_port_cnt {
        // SAFETY: zeroed POD out-struct.
        let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx valid, port number within phys_port_cnt.
        if unsafe { ___ibv_query_port(ctx, num, &mut pa) } != 0 {
            continue;
        }
        let mut gids = Vec::new();
        for index in 0..pa.gid_tbl_len.max(0) as u32 {
            // SAFETY: zeroed POD out-struct.
            let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: ctx valid, index < gid_tbl_len.
            if unsafe { ibv_query_gid(ctx, num, index as i32, &mut gid) } != 0 {
                continue;
            }
            // SAFETY: every bit pattern is a valid [u8; 16].
            let raw = unsafe { gid.raw };
            if raw.iter().all(|b| *b == 0) {
                continue;
            }
            gids.push(GidInfo {
                index,
                gid: raw,
                kind: sysfs(&name, num, "types", index),
                netdev: sysfs(&name, num, "ndevs", index),
            });
        }
        ports.push(PortInfo {
            num,
            active: pa.state == ibv_port_state::IBV_PORT_ACTIVE,
            // SAFETY: returns a static string for any value.
            state: cstr(unsafe { ibv_port_state_str(pa.state) }),
            mtu: mtu_bytes(pa.active_mtu),
            link_layer: if pa.link_layer == 2 { "Ethernet" } else { "InfiniBand" },
            gids,
        });
    }
    Ok(DeviceInfo {
        name,
        max_mr_size: attr.max_mr_size,
        max_mr: attr.max_mr,
        max_qp_wr: attr.max_qp_wr,
        max_cqe: attr.max_cqe,
        max_qp_rd_atom: attr.max_qp_rd_atom,
        max_qp_init_rd_atom: attr.max_qp_init_rd_atom,
        max_srq_wr: attr.max_srq_wr,
        max_sge: attr.max_sge,
        max_mw: attr.max_mw,
        mw_type2: attr.max_mw > 0
            && attr.device_cap_flags
                & (ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0 | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0)
                != 0,
        ports,
    })
}

/// Every RDMA device on this host, opened and queried through libibverbs.
/// An empty list is not an error here; [`check_viable`] turns it into one.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    let mut n: libc::c_int = 0;
    // SAFETY: n is a valid out-pointer; the list is freed below.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        // ENOSYS/ENOENT: no uverbs support in this kernel at all.
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds n valid device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: dev comes from the live list.
        let ctx = unsafe { ibv_open_device(dev) };
        if ctx.is_null() {
            let err = std::io::Error::last_os_error();
            // SAFETY: dev comes from the live list.
            let name = cstr(unsafe { ibv_get_device_name(dev) });
            log::warn!("verbs: cannot open {name}: {err}");
            continue;
        }
        // SAFETY: ctx was just opened.
        let info = unsafe { query_context(ctx) };
        // SAFETY: ctx opened above, closed exactly once.
        unsafe { ibv_close_device(ctx) };
        match info {
            Ok(info) => out.push(info),
            Err(e) => log::warn!("verbs: {e}"),
        }
    }
    // SAFETY: list came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(out)
}

/// The viability rule: at least one device (the override's, when set) with
/// an active port (the override's, when set), and a usable memlock limit.
pub fn check_viable(devs: &[DeviceInfo], want_dev: Option<&str>, want_port: Option<u8>) -> Result<()> {
    if devs.is_empty() {
        return Err(Error::NotViable(
            "no RDMA device found (ibv_get_device_list returned 0)".into(),
        ));
    }
    let names = || devs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ");
    let cands: Vec<&DeviceInfo> = match want_dev {
        Some(w) => devs.iter().filter(|d| d.name == w).collect(),
        None => devs.iter().collect(),
    };
    if cands.is_empty() {
        return Err(Error::NotViable(format!(
            "RDMA_DEVICE_VERBS_DEVICE={} names no RDMA device (found: {})",
            want_dev.unwrap_or(""),
            names()
        )));
    }
    let active = cands.iter().any(|d| {
        d.ports.iter().any(|p| p.active && want_port.map_or(true, |w| w == p.num))
    });
    if !active {
        return Err(Error::NotViable(format!(
            "no active RDMA port{} (devices: {})",
            want_port.map(|p| format!(" {p}")).unwrap_or_default(),
            cands.iter().map(|d| d.describe()).collect::<Vec<_>>().join("; ")
        )));
    }
    memlock_check(super::MIN_MEMLOCK_BYTES, "connection buffers")
        .map_err(|e| Error::NotViable(e.message().to_string()))
}

/// Whether this process may pin memory without limit (CAP_IPC_LOCK).
/// Read once (`/proc/self/status`): the limit is asked before each new
/// registration, and a process's capabilities do not grow.
fn has_ipc_lock() -> bool {
    static CAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        const CAP_IPC_LOCK: u32 = 14;
        let Ok(s) = std::fs::read_to_string("/proc/self/status") else { return false };
        s.lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
    })
}

/// The memlock limit in bytes (`None` = unlimited or CAP_IPC_LOCK).
pub fn memlock_limit() -> Option<u64> {
    if has_ipc_lock() {
        return None;
    }
    // SAFETY: zeroed POD out-struct.
    let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: rl is a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return None;
    }
    (rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur)
}

/// Fail with a message naming the fix when `need` bytes cannot be pinned.
pub fn memlock_check(need: u64, what: &str) -> Result<()> {
    memlock_verdict(memlock_limit(), need, what)
}

fn memlock_verdict(limit: Option<u64>, need: u64, what: &str) -> Result<()> {
    match limit {
        Some(lim) if lim < need => Err(Error::ResourceExhausted(format!(
            "RLIMIT_MEMLOCK is {lim} bytes but the RDMA verbs backend must pin {need} bytes \
             ({what}); raise it: `ulimit -l unlimited` in the shell that starts the job, \
             `* - memlock unlimited` in /etc/security/limits.conf, LimitMEMLOCK=infinity for \
             systemd units, or `--ulimit memlock=-1` for containers"
        ))),
        _ => Ok(()),
    }
}

/// An open device context. librdmacm owns the contexts (it opens every
/// device once per process); this handle keeps the list that names them.
pub struct Context {
    list: *mut *mut ibv_context,
    pub(crate) raw: *mut ibv_context,
    pub info: DeviceInfo,
}

// SAFETY: ibv_context is thread-safe per libibverbs; the list is immutable.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// The first device librdmacm knows (for measurements).
    pub fn first() -> Result<Arc<Context>> {
        let mut n: libc::c_int = 0;
        // SAFETY: n is a valid out-pointer; the list is freed at once (the
        // contexts it names stay open inside librdmacm).
        let list = unsafe { rdma_get_devices(&mut n) };
        if list.is_null() || n < 1 {
            if !list.is_null() {
                // SAFETY: from rdma_get_devices, freed once.
                unsafe { rdma_free_devices(list) };
            }
            return Err(Error::NotViable("no RDMA device found (rdma_get_devices returned 0)".into()));
        }
        // SAFETY: n >= 1 valid entries.
        let raw = unsafe { *list };
        // SAFETY: from rdma_get_devices, freed once.
        unsafe { rdma_free_devices(list) };
        // SAFETY: raw is one of librdmacm's open contexts.
        unsafe { Context::for_cm(raw) }
    }

    /// The librdmacm context at `raw` (from an `rdma_cm_id`).
    ///
    /// # Safety
    /// `raw` must be a live context owned by librdmacm.
    pub unsafe fn for_cm(raw: *mut ibv_context) -> Result<Arc<Context>> {
        let mut n: libc::c_int = 0;
        // SAFETY: n is a valid out-pointer; freed in Drop.
        let list = unsafe { rdma_get_devices(&mut n) };
        if list.is_null() {
            return Err(Error::last_os("rdma_get_devices"));
        }
        // SAFETY: raw is a live librdmacm context (ids hold it open).
        let info = unsafe { query_context(raw) };
        let ctx = Context { list, raw, info: info? };
        Ok(Arc::new(ctx))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: list came from rdma_get_devices; freed exactly once.
        unsafe { rdma_free_devices(self.list) };
    }
}

/// A protection domain.
pub struct Pd {
    pub(crate) raw: *mut ibv_pd,
    pub ctx: Arc<Context>,
}

// SAFETY: verbs objects are thread-safe handles.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(ctx: Arc<Context>) -> Result<Arc<Pd>> {
        // SAFETY: ctx.raw is a live context.
        let raw = unsafe { ibv_alloc_pd(ctx.raw) };
        if raw.is_null() {
            return Err(Error::last_os(&format!("ibv_alloc_pd({})", ctx.info.name)));
        }
        Ok(Arc::new(Pd { raw, ctx }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: raw came from ibv_alloc_pd; all MRs/QPs holding it are gone.
        let rc = unsafe { ibv_dealloc_pd(self.raw) };
        if rc != 0 {
            log::warn!("verbs: ibv_dealloc_pd failed ({rc})");
        }
    }
}

/// A completion channel (one fd the progress thread can block on).
pub struct CompChannel {
    pub(crate) raw: *mut ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: thread-safe handle; only the progress thread reads events.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub fn new(ctx: Arc<Context>) -> Result<Arc<CompChannel>> {
        // SAFETY: ctx.raw is a live context.
        let raw = unsafe { ibv_create_comp_channel(ctx.raw) };
        if raw.is_null() {
            return Err(Error::last_os("ibv_create_comp_channel"));
        }
        // SAFETY: raw is valid; fd belongs to it.
        let fd = unsafe { (*raw).fd };
        set_nonblocking(fd)?;
        Ok(Arc::new(CompChannel { raw, _ctx: ctx }))
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: raw is valid for our lifetime.
        unsafe { (*self.raw).fd }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: raw from ibv_create_comp_channel; its CQs are destroyed.
        unsafe { ibv_destroy_comp_channel(self.raw) };
    }
}

/// A completion queue attached to a completion channel.
pub struct Cq {
    pub(crate) raw: *mut ibv_cq,
    pub channel: Arc<CompChannel>,
    pub capacity: u32,
}

// SAFETY: thread-safe handle; only the progress thread polls it.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn new(ctx: &Context, channel: Arc<CompChannel>, cqe: u32) -> Result<Arc<Cq>> {
        // SAFETY: ctx and channel are live; no cq_context pointer is used.
        let raw = unsafe {
            ibv_create_cq(ctx.raw, cqe as i32, std::ptr::null_mut(), channel.raw, 0)
        };
        if raw.is_null() {
            return Err(Error::last_os(&format!("ibv_create_cq({cqe} entries)")));
        }
        Ok(Arc::new(Cq { raw, channel, capacity: cqe }))
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: raw from ibv_create_cq; QPs using it are destroyed and its
        // events acknowledged (the progress thread acks as it reads).
        let rc = unsafe { ibv_destroy_cq(self.raw) };
        if rc != 0 {
            log::warn!("verbs: ibv_destroy_cq failed ({rc})");
        }
    }
}

pub fn set_nonblocking(fd: i32) -> Result<()> {
    // SAFETY: fcntl on an fd we own; plain flags.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(Error::last_os("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_message_names_the_fix() {
        assert!(memlock_verdict(None, u64::MAX, "x").is_ok());
        assert!(memlock_verdict(Some(1 << 30), 1 << 20, "x").is_ok());
        let e = memlock_verdict(Some(65536), 16 << 20, "connection buffers").unwrap_err();
        assert!(matches!(e, Error::ResourceExhausted(_)));
        for part in ["65536", "ulimit -l unlimited", "limits.conf", "connection buffers"] {
            assert!(e.message().contains(part), "{e}");
        }
    }

    #[test]
    fn viability_reasons() {
        let e = check_viable(&[], None, None).unwrap_err();
        assert_eq!(e, Error::NotViable("no RDMA device found (ibv_get_device_list returned 0)".into()));
        let dev = DeviceInfo {
            name: "rxe0".into(),
            max_mr_size: u64::MAX,
            max_mr: 1,
            max_mw: 0,
            mw_type2: false,
            max_qp_wr: 1,
            max_cqe: 1,
            max_qp_rd_atom: 1,
            max_qp_init_rd_atom: 1,
            max_srq_wr: 1,
            max_sge: 1,
            ports: vec![PortInfo { num: 1, active: false, state: "DOWN".into(), mtu: 1024, link_layer: "Ethernet", gids: vec![] }],
        };
        let e = check_viable(std::slice::from_ref(&dev), Some("mlx5_0"), None).unwrap_err();
        assert!(e.message().contains("mlx5_0") && e.message().contains("rxe0"), "{e}");
        let e = check_viable(std::slice::from_ref(&dev), None, None).unwrap_err();
        assert!(e.message().contains("no active RDMA port"), "{e}");
    }

    #[test]
    fn ipv4_mapped_gid() {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 2, 15]);
        let gi = GidInfo { index: 1, gid: g, kind: "RoCE v2".into(), netdev: "eth0".into() };
        assert_eq!(gi.ipv4(), Some(std::net::Ipv4Addr::new(10, 0, 2, 15)));
        assert_eq!(gid_str(&g), "::ffff:10.0.2.15");
    }
}
