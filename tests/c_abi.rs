//! A C program compiled against include/rdma_device.h links the shared
//! library and does a send/recv through it (tests/c/smoke.c).

use std::path::PathBuf;
use std::process::Command;

/// A loopback port held by this process until it exits (the shm socket is
/// named after the address, so no other test may get the same port).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::mem::forget(l);
    port
}

#[test]
fn c_program_sends_and_receives_through_the_header() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // target/<profile>/deps/c_abi-* → target/<profile> holds librdma_device.so
    let exe = std::env::current_exe().unwrap();
    let libdir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    // `cargo test` builds the library as an rlib only; build the cdylib
    // (same profile, same features) so the C program links the real thing.
    let profile = libdir.file_name().unwrap().to_string_lossy().to_string();
    let mut build = Command::new(env!("CARGO"));
    build.current_dir(&root).args(["build", "--lib", "--quiet"]);
    if profile == "release" {
        build.arg("--release");
    }
    if cfg!(feature = "verbs") {
        build.args(["--features", "verbs"]);
    }
    if let Some(target) = libdir.parent() {
        build.env("CARGO_TARGET_DIR", target);
    }
    let st = build.status().expect("run cargo build");
    assert!(st.success(), "cargo build --lib failed");
    assert!(libdir.join("librdma_device.so").exists(), "cdylib not built in {}", libdir.display());
    let out = std::env::temp_dir().join(format!("rdev-smoke-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I").arg(root.join("include"))
        .arg(root.join("tests/c/smoke.c"))
        .arg("-L").arg(&libdir)
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .args(["-lrdma_device", "-lpthread", "-o"])
        .arg(&out)
        .status()
        .expect("run the C compiler");
    assert!(st.success(), "C smoke test failed to compile");
    let o = Command::new(&out).arg(free_port().to_string()).arg(free_port().to_string()).output().unwrap();
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "smoke failed: {stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("c smoke: ok"), "{stdout}");
}
