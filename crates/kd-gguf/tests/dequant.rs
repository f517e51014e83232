//! Dequantisation of random blocks of every supported type, bit for bit against the `gguf`
//! Python package's `gguf.quants.dequantize` (fixtures/make_gguf_golden.py, part A).

use kd_gguf::{GgmlType, dequantize};

#[test]
fn every_type_matches_the_gguf_package_bit_for_bit() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/golden/gguf/dequant.json"
    );
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let mut seen = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let ty = GgmlType::from_id(case["ggml_type"].as_u64().unwrap() as u32);
        assert_eq!(ty.name(), name);
        let (block, size) = ty.block().unwrap();
        assert_eq!(block as u64, case["block_size"].as_u64().unwrap(), "{name}");
        assert_eq!(size as u64, case["type_size"].as_u64().unwrap(), "{name}");
        let hex = case["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(want.len() as u64, case["n_elements"].as_u64().unwrap());
        let mut got = vec![f32::NAN; want.len()];
        dequantize(ty, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs {w}");
        }
        seen.push(name.to_string());
    }
    for name in [
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    ] {
        assert!(seen.iter().any(|s| s == name), "no golden case for {name}");
    }
}
