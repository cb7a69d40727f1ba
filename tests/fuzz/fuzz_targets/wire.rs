//! Every decoder a peer can feed directly: control messages of all types,
//! the handshake, slot headers written into shared memory, and the verbs
//! connect/accept private data. A decode must never panic; whatever decodes
//! must re-encode to something that decodes to the same value.
#![no_main]

use rdma_device::constants::HEADER_BYTES;
use rdma_device::fuzzing::{AcceptData, ConnectData};
use rdma_device::rendezvous::{Hello, Msg, SlotHeader};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&which, b)) = data.split_first() else { return };
    match which % 5 {
        0 => {
            if let Ok(m) = Msg::decode(b) {
                assert_eq!(Msg::decode(&m.encode()).ok().as_ref(), Some(&m), "message round trip");
            }
        }
        1 => {
            if let Ok(h) = Hello::decode(b) {
                assert_eq!(Hello::decode(&h.encode()).ok().as_ref(), Some(&h), "hello round trip");
            }
        }
        2 => {
            if let Ok(h) = SlotHeader::decode(b) {
                let e = h.encode();
                assert_eq!(e.len(), HEADER_BYTES);
                assert_eq!(SlotHeader::decode(&e).ok().as_ref(), Some(&h), "slot header round trip");
            }
        }
        3 => {
            if let Ok(c) = ConnectData::decode(b) {
                assert_eq!(ConnectData::decode(&c.encode()).ok(), Some(c));
            }
        }
        _ => {
            if let Ok(a) = AcceptData::decode(b) {
                assert_eq!(AcceptData::decode(&a.encode()).ok(), Some(a));
            }
        }
    }
});
