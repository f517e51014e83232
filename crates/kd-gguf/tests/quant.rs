//! Q8_0 quantisation byte for byte against the `gguf` Python package's `gguf.quants.quantize`
//! (fixtures/make_q8_0_golden.py), and back through the dequantiser.

use kd_gguf::{DequantError, GgmlType, dequantize, quantize_q8_0};

#[test]
fn q8_0_blocks_match_the_gguf_package_byte_for_byte() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/golden/gguf/q8_0-quantize.json"
    );
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let values: Vec<f32> = golden["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let hex = golden["hex"].as_str().unwrap();
    let want: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let got = quantize_q8_0(&values).unwrap();
    assert_eq!(got.len(), want.len());
    for (b, (g, w)) in got.chunks(34).zip(want.chunks(34)).enumerate() {
        assert_eq!(g, w, "block {b}");
    }
    // Back to f32: within half a step of every value, plus what rounding the scale to f16
    // costs (127 · 2⁻¹¹ of a step). A scale below f16's normal range (the block of 1e-30
    // values) is not representable, and the block comes back as zeros.
    let mut back = vec![0f32; values.len()];
    dequantize(GgmlType::Q8_0, &got, &mut back).unwrap();
    for (block, (x, y)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
        let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        if step < 6.2e-5 {
            assert!(step == 0.0 || y.iter().all(|v| *v == 0.0), "block {block}");
            continue;
        }
        for (a, b) in x.iter().zip(y) {
            assert!((a - b).abs() <= 0.57 * step, "block {block}: {a} vs {b}");
        }
    }
}

#[test]
fn q8_0_needs_whole_blocks() {
    assert!(matches!(
        quantize_q8_0(&[1.0; 33]),
        Err(DequantError::Length { values: 33, .. })
    ));
    assert_eq!(quantize_q8_0(&[]).unwrap(), Vec::<u8>::new());
}
