//! The writer against the `gguf` Python package's `GGUFWriter`
//! (fixtures/make_gguf_writer_golden.py): the same keys and tensors give the same bytes; and
//! what it writes reads back.

use half::f16;
use kd_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, quantize_q8_0};

fn le<T: Copy, const N: usize>(values: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| f(v)).collect()
}

/// The contents of fixtures/make_gguf_writer_golden.py, in its order.
fn golden_contents() -> GgufWriter {
    let mut w = GgufWriter::new("eagle3");
    let keys = [
        ("test.u8", Value::U8(200)),
        ("test.i8", Value::I8(-100)),
        ("test.u16", Value::U16(60000)),
        ("test.i16", Value::I16(-30000)),
        ("test.u32", Value::U32(4_000_000_000)),
        ("test.i32", Value::I32(-2_000_000_000)),
        ("test.u64", Value::U64((1 << 40) + 3)),
        ("test.i64", Value::I64(-(1 << 40) - 5)),
        ("test.f32", Value::F32(0.375)),
        ("test.f64", Value::F64(-1.0e300)),
        ("test.bool", Value::Bool(true)),
        ("test.string", Value::String("héllo, GGUF".into())),
        (
            "test.strings",
            Value::Array(["a", "", "ünï"].map(|s| Value::String(s.into())).to_vec()),
        ),
        (
            "test.ints",
            Value::Array(vec![2, 15, 27].into_iter().map(Value::I32).collect()),
        ),
        (
            "test.floats",
            Value::Array(vec![Value::F32(0.5), Value::F32(-2.25)]),
        ),
        (
            "test.bools",
            Value::Array(vec![Value::Bool(false), Value::Bool(true)]),
        ),
    ];
    for (k, v) in keys {
        w.add(k, v).unwrap();
    }
    let f32s: Vec<f32> = (0..6).map(|i| i as f32 / 4.0 - 0.5).collect();
    w.add_tensor("t.f32", GgmlType::F32, &[2, 3], le(&f32s, f32::to_le_bytes))
        .unwrap();
    let f16s: Vec<f16> = (0..5).map(|i| f16::from_f32(i as f32 * 1.5)).collect();
    w.add_tensor("t.f16", GgmlType::F16, &[5], le(&f16s, f16::to_le_bytes))
        .unwrap();
    w.add_tensor(
        "t.i32",
        GgmlType::I32,
        &[4],
        le(&[7i32, -8, 9, i32::MAX], i32::to_le_bytes),
    )
    .unwrap();
    w.add_tensor(
        "t.i64",
        GgmlType::I64,
        &[3],
        le(&[3i64, -(1 << 40), 5], i64::to_le_bytes),
    )
    .unwrap();
    let q: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 8.0).collect();
    w.add_tensor(
        "t.q8_0",
        GgmlType::Q8_0,
        &[2, 32],
        quantize_q8_0(&q).unwrap(),
    )
    .unwrap();
    w
}

#[test]
fn the_same_contents_give_the_gguf_packages_bytes() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/golden/gguf/writer.gguf"
    );
    let want = std::fs::read(path).unwrap();
    let got = golden_contents().to_bytes().unwrap();
    assert_eq!(got.len(), want.len());
    if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!("first difference at byte {at}");
    }
}

#[test]
fn what_is_written_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.gguf");
    let mut w = golden_contents();
    w.add("general.alignment", Value::U32(64)).unwrap();
    std::fs::write(&path, w.to_bytes().unwrap()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.str("general.architecture").unwrap(), "eagle3");
    assert_eq!(f.get("test.i64"), Some(&Value::I64(-(1 << 40) - 5)));
    assert_eq!(f.opt_ints("test.ints").unwrap(), Some(vec![2, 15, 27]));
    assert_eq!(f.strings("test.strings").unwrap(), ["a", "", "ünï"]);
    let t = f.tensor("t.f32").unwrap();
    assert_eq!((t.shape(), t.ty), (vec![2, 3], GgmlType::F32));
    assert_eq!(
        f.dequantize("t.f32").unwrap(),
        [-0.5, -0.25, 0.0, 0.25, 0.5, 0.75]
    );
    // With a 64-byte alignment every tensor starts on a multiple of 64.
    assert!(f.tensors().iter().all(|t| t.offset % 64 == 0));
    let i64s = f.tensor_bytes("t.i64").unwrap();
    assert_eq!(i64s, le(&[3i64, -(1 << 40), 5], i64::to_le_bytes));
    // Integers have bytes but no f32 values.
    assert!(matches!(
        f.dequantize("t.i64"),
        Err(GgufError::UnsupportedType { .. })
    ));
    let q: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 8.0).collect();
    let back = f.dequantize("t.q8_0").unwrap();
    assert!(q.iter().zip(&back).all(|(a, b)| (a - b).abs() < 0.03));
}

#[test]
fn what_gguf_cannot_hold_is_refused_by_name() {
    let mut w = GgufWriter::new("llama");
    let err = |e: GgufError| e.to_string();
    assert!(
        err(w.add("general.architecture", Value::U32(1)).unwrap_err())
            .contains("`general.architecture`: added twice")
    );
    assert!(err(w.add("k.empty", Value::Array(vec![])).unwrap_err()).contains("empty array"));
    assert!(
        err(w
            .add("k.mixed", Value::Array(vec![Value::U32(1), Value::I32(1)]))
            .unwrap_err())
        .contains("mixed item types")
    );
    let e = w
        .add_tensor("w", GgmlType::F32, &[2, 3], vec![0; 20])
        .unwrap_err();
    assert!(err(e).contains("tensor `w`: 20 bytes of F32 for shape [2, 3]"));
    let e = w
        .add_tensor("q", GgmlType::Q8_0, &[1, 48], vec![0; 34])
        .unwrap_err();
    assert!(err(e).contains("blocks of 32"));
    w.add_tensor("w", GgmlType::F32, &[1], vec![0; 4]).unwrap();
    let e = w
        .add_tensor("w", GgmlType::F32, &[1], vec![0; 4])
        .unwrap_err();
    assert!(err(e).contains("`w`: added twice"));
    w.add("general.alignment", Value::U32(48)).unwrap();
    assert!(err(w.to_bytes().unwrap_err()).contains("power of two"));
}
