//! The checked-in C header must be exactly what cbindgen generates from
//! the current source. `RDEV_BLESS=1 cargo test --test header` rewrites it.

use std::path::PathBuf;

#[test]
fn header_is_current() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let cfg = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&root)
        .with_config(cfg)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    let path = root.join("include/rdma_device.h");
    if std::env::var("RDEV_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &out).expect("write header");
        return;
    }
    let have = std::fs::read(&path).unwrap_or_default();
    assert!(
        have == out,
        "include/rdma_device.h is stale: run `RDEV_BLESS=1 cargo test --test header` and commit it"
    );
}
