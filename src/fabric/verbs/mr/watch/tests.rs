//! Unit tests of the mapping watch (they skip where the process cannot
//! open a userfaultfd): unmap, discard and move are reported; a forked
//! child leaves the parent's watch alone; a range stays watched while any
//! holder covers it.

use super::*;

fn anon(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: just mapped, len bytes.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 1, len) };
    p.cast()
}

/// The process's watch, or `None` (saying SKIPPED) where this kernel
/// has no userfaultfd to watch with. The line also goes to
/// `RDMA_DEVICE_SKIP_LOG` when set, as the integration tests' skips do
/// (tests/common), so `.ci/test.sh` lists the test as skipped rather than
/// passed.
fn watch_or_skip() -> Option<&'static Watch> {
    match Watch::get() {
        Ok(w) => Some(w),
        Err(e) => {
            use std::io::Write;
            let name = std::thread::current().name().unwrap_or("?").to_string();
            eprintln!("SKIPPED {name}: no userfaultfd here ({e})");
            if let Some(path) = std::env::var_os("RDMA_DEVICE_SKIP_LOG") {
                if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                    // One write per line: tests skip from several threads.
                    let _ = f.write_all(format!("lib {name}: no userfaultfd here ({e})\n").as_bytes());
                }
            }
            None
        }
    }
}

/// Discard one page of our own mapping (MADV_DONTNEED: a watched event).
fn discard(at: u64, page: u64) {
    // SAFETY: discarding a page of a mapping the test owns.
    assert_eq!(unsafe { libc::madvise(at as *mut _, page as usize, libc::MADV_DONTNEED) }, 0);
}

fn events(w: &Watch, from: &mut u64) -> Vec<(u64, u64)> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while w.busy() && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    let mut v = Vec::new();
    match w.since(*from, |s, e| v.push((s, e))) {
        Since::Upto(h) | Since::Lost(h) => *from = h,
    }
    v
}

/// munmap, madvise(DONTNEED) and mremap of a watched range are each
/// reported before the call returns; writes cause no fault; shared
/// memory is refused.
#[test]
fn reports_unmap_discard_and_move() {
    let Some(w) = watch_or_skip() else { return };
    let page = crate::fabric::arena::page_size();
    let len = 16 * page;
    let mut from = w.head();
    let p = anon(len) as u64;
    let _held = w.watch(p, p + len as u64).expect("watch private anonymous memory");
    // SAFETY: our mapping; a write must not fault into the watch.
    unsafe { std::ptr::write_bytes(p as *mut u8, 2, len) };
    assert!(events(w, &mut from).is_empty());
    // SAFETY: discarding pages of our own mapping.
    assert_eq!(unsafe { libc::madvise((p + page as u64) as *mut _, page, libc::MADV_DONTNEED) }, 0);
    assert!(events(w, &mut from).contains(&(p + page as u64, p + 2 * page as u64)));
    // SAFETY: moving our own mapping (the source goes away).
    let q = unsafe { libc::mremap(p as *mut _, len, 2 * len, libc::MREMAP_MAYMOVE) };
    assert_ne!(q, libc::MAP_FAILED);
    let q = q as u64;
    if q != p {
        assert!(events(w, &mut from).iter().any(|(s, _)| *s == p), "mremap reported");
    }
    // SAFETY: unmapping our own mapping.
    assert_eq!(unsafe { libc::munmap(q as *mut _, 2 * len) }, 0);
    assert!(events(w, &mut from).iter().any(|(s, e)| *s <= q && *e > q), "munmap reported");
    // Shared memory is not watched (it can lose pages through its fd).
    // SAFETY: a fresh shared anonymous mapping, unmapped below.
    let s = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(s, libc::MAP_FAILED);
    // SAFETY: our mapping.
    unsafe { std::ptr::write_bytes(s.cast::<u8>(), 1, len) };
    assert!(w.watch(s as u64, s as u64 + len as u64).is_err());
    // SAFETY: ours.
    unsafe { libc::munmap(s, len) };
}

/// Issue 18, N7: a forked child inherits the watch's descriptor, which
/// still acts on the parent's address space, but not its thread. The
/// child neither watches anything nor lets go of the parent's watch
/// when it drops what it inherited: the parent still hears of changes.
#[test]
fn a_forked_child_leaves_the_parents_watch_alone() {
    let Some(w) = watch_or_skip() else { return };
    let page = crate::fabric::arena::page_size() as u64;
    let p = anon(4 * page as usize) as u64;
    let mut from = w.head();
    let held = w.watch(p, p + 4 * page).unwrap();
    assert!(!forked());
    // SAFETY: the child only touches atomics and its own copy of
    // `held`, then leaves with _exit (no destructors, no locks).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        drop(held);
        let ok = forked() && w.watch(p, p + 4 * page).is_err();
        // SAFETY: leaving the child at once.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut status = 0;
    loop {
        // SAFETY: our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if std::time::Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child did not finish within 10 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "in the child: not marked forked, or it could watch (status {status:#x})");
    discard(p + page, page);
    assert!(events(w, &mut from).contains(&(p + page, p + 2 * page)), "the child's drop unwatched the parent's range");
    drop(held);
}

/// Issue 18, N2: several holders over one range (two devices' caches,
/// a newer entry over an older one's pages). When one lets go, what
/// the others cover stays watched; only pages no holder covers are
/// unwatched.
#[test]
fn a_range_stays_watched_while_any_holder_covers_it() {
    let Some(w) = watch_or_skip() else { return };
    let page = crate::fabric::arena::page_size() as u64;
    let p = anon(8 * page as usize) as u64;
    let mut from = w.head();
    let whole = w.watch(p, p + 8 * page).unwrap(); // cache of device A
    let same = w.watch(p, p + 8 * page).unwrap(); // cache of device B
    let inner = w.watch(p + 2 * page, p + 4 * page).unwrap(); // a newer entry
    let discard = |at: u64| discard(at, page);
    drop(whole); // A evicts its entry: B still watches all of it
    discard(p + 7 * page);
    assert!(events(w, &mut from).contains(&(p + 7 * page, p + 8 * page)), "B lost its watch when A let go");
    drop(same); // only the inner entry is left
    discard(p + 3 * page);
    assert!(events(w, &mut from).contains(&(p + 3 * page, p + 4 * page)), "the inner entry lost its watch");
    discard(p + 6 * page);
    assert!(!events(w, &mut from).iter().any(|(a, b)| *a < p + 7 * page && *b > p + 6 * page), "a page no holder covers is still watched");
    drop(inner);
    discard(p + 3 * page);
    assert!(events(w, &mut from).iter().all(|(a, b)| *b <= p || *a >= p + 8 * page), "still watched after every holder let go");
    // SAFETY: ours.
    unsafe { libc::munmap(p as *mut _, 8 * page as usize) };
}
