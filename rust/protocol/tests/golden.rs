//! Golden vectors written by `tools/gen_protocol_golden.py` from the msgspec structs: every
//! `<name>.msgpack` must decode to the meaning in `<name>.json` and re-encode byte for byte.

use std::path::{Path, PathBuf};

use voltllm_protocol::{Message, MessageType};

fn golden_dir() -> PathBuf {
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
        .join("../../tests/protocol/golden")
}

/// The typed message that the JSON meaning describes (arrays for hot messages, maps otherwise).
fn from_json(kind: MessageType, payload: serde_json::Value) -> Message {
    fn de<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("golden JSON matches the Rust type")
    }
    match kind {
        MessageType::Add => Message::Add(de(payload)),
        MessageType::Abort => Message::Abort(de(payload)),
        MessageType::Utility => Message::Utility(de(payload)),
        MessageType::Ready => Message::Ready(de(payload)),
        MessageType::Outputs => Message::Outputs(de(payload)),
        MessageType::UtilityResult => Message::UtilityResult(de(payload)),
        MessageType::Error => Message::Error(de(payload)),
        MessageType::Dead => Message::Dead(de(payload)),
    }
}

#[test]
fn golden_vectors_decode_to_their_meaning_and_reencode_identically() {
    let mut seen = 0;
    let mut kinds = std::collections::HashSet::new();
    for entry in std::fs::read_dir(golden_dir()).expect("golden vectors are checked in") {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("msgpack") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let meaning: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("json")).unwrap()).unwrap();
        let type_byte = meaning["type_byte"].as_u64().unwrap() as u8;
        let kind = MessageType::try_from(type_byte).unwrap();

        let decoded = Message::decode(&[&[type_byte][..], &bytes[..]])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = from_json(kind, meaning["payload"].clone());
        assert_eq!(
            decoded, expected,
            "{name}: decoded value differs from its meaning"
        );

        let [kind_frame, payload] = decoded.encode().unwrap();
        assert_eq!(kind_frame, vec![type_byte], "{name}: type byte");
        assert_eq!(payload, bytes, "{name}: re-encoding is not byte-identical");
        kinds.insert(type_byte);
        seen += 1;
    }
    assert!(
        seen >= 8,
        "expected the full golden set, found {seen} vectors"
    );
    assert_eq!(kinds.len(), 8, "every message type has a golden vector");
}
