//! The backend conformance suite on the shm backend.

use std::sync::Arc;
use std::time::Duration;

use rdma_device::fabric::conformance::Harness;
use rdma_device::fabric::shm::ShmFabric;

fn harness() -> Harness {
    Harness {
        fabric: Arc::new(ShmFabric::new(Duration::from_micros(50))),
        addr: Box::new(|| {
            let p = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            format!("localhost:{p}")
        }),
    }
}

rdma_device::fabric_conformance_tests!(harness);

#[test]
fn shm_reaches_only_this_host() {
    use rdma_device::fabric::Fabric;
    let f = ShmFabric::new(Duration::ZERO);
    assert!(f.reaches("localhost:1").is_ok());
    assert!(f.reaches("127.0.0.1:1").is_ok());
    assert!(f.reaches("192.0.2.1:1").is_err(), "TEST-NET address is never local");
}
