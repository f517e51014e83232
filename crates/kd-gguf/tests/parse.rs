//! The reader on small files written here: metadata types, alignment, and every kind of bad
//! file (wrong magic, version, truncation anywhere, impossible counts, unknown types).

use std::io::Write;

use kd_gguf::{GgmlType, GgufError, GgufFile, Value};

/// A minimal GGUF writer (version 3) for tests.
#[derive(Default)]
struct Writer {
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    alignment: Option<u64>,
}

fn gguf_string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

impl Writer {
    fn kv(mut self, key: &str, ty: u32, payload: Vec<u8>) -> Self {
        self.kv.push((key.into(), ty, payload));
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let align = self.alignment.unwrap_or(32);
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        let n_kv = self.kv.len() + usize::from(self.alignment.is_some());
        out.extend_from_slice(&(n_kv as u64).to_le_bytes());
        if let Some(a) = self.alignment {
            out.extend(gguf_string("general.alignment"));
            out.extend_from_slice(&4u32.to_le_bytes());
            out.extend_from_slice(&(a as u32).to_le_bytes());
        }
        for (k, ty, payload) in &self.kv {
            out.extend(gguf_string(k));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(payload);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            out.extend(gguf_string(name));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).next_multiple_of(align);
        }
        let start = (out.len() as u64).next_multiple_of(align);
        out.resize(start as usize, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize((start + off) as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

fn write(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    f.flush().unwrap();
    f
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn sample() -> Writer {
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend_from_slice(&2u64.to_le_bytes());
    arr.extend(gguf_string("a"));
    arr.extend(gguf_string("é b"));
    Writer::default()
        .kv("general.architecture", 8, gguf_string("llama"))
        .kv("llama.block_count", 4, 30u32.to_le_bytes().to_vec())
        .kv("llama.rope.freq_base", 6, 100000f32.to_le_bytes().to_vec())
        .kv("x.neg", 5, (-3i32).to_le_bytes().to_vec())
        .kv("x.flag", 7, vec![1])
        .kv("x.list", 9, arr)
        .tensor("w", &[3, 2], 0, f32_bytes(&[1., 2., 3., 4., 5., 6.]))
        .tensor(
            "v",
            &[2],
            1,
            [half::f16::from_f32(0.5), half::f16::from_f32(-2.0)]
                .iter()
                .flat_map(|h| h.to_le_bytes())
                .collect(),
        )
}

#[test]
fn reads_metadata_and_tensors() {
    let f = write(&sample().bytes());
    let g = GgufFile::open(f.path()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.str("general.architecture").unwrap(), "llama");
    assert_eq!(g.uint("llama.block_count").unwrap(), 30);
    assert_eq!(g.opt_float("llama.rope.freq_base").unwrap(), Some(100000.0));
    assert_eq!(g.get("x.neg"), Some(&Value::I32(-3)));
    assert_eq!(g.opt_bool("x.flag").unwrap(), Some(true));
    assert_eq!(g.strings("x.list").unwrap(), ["a", "é b"]);
    assert_eq!(g.opt_uint("absent").unwrap(), None);
    let w = g.tensor("w").unwrap();
    assert_eq!(w.shape(), [2, 3]);
    assert_eq!(w.ty, GgmlType::F32);
    assert_eq!(g.dequantize("w").unwrap(), [1., 2., 3., 4., 5., 6.]);
    assert_eq!(g.dequantize("v").unwrap(), [0.5, -2.0]);
    // Shared bytes: the mapped tensor itself, still readable once the file handle is gone.
    let shared = g.shared_tensor_bytes("w").unwrap();
    assert!(shared.is_mapped());
    assert_eq!(&shared[..], g.tensor_bytes("w").unwrap());
    assert!(g.shared_tensor_bytes("absent").is_err());
    drop(g);
    assert_eq!(&shared[..], &f32_bytes(&[1., 2., 3., 4., 5., 6.])[..]);
    let owned = kd_gguf::SharedBytes::from(vec![1u8, 2]);
    assert!(!owned.is_mapped() && owned[..] == [1, 2]);
}

#[test]
fn custom_alignment() {
    let mut w = sample();
    w.alignment = Some(64);
    let f = write(&w.bytes());
    let g = GgufFile::open(f.path()).unwrap();
    assert_eq!(g.dequantize("v").unwrap(), [0.5, -2.0]);
}

#[test]
fn wrong_key_types_name_the_key() {
    let f = write(&sample().bytes());
    let g = GgufFile::open(f.path()).unwrap();
    let e = g.uint("general.architecture").unwrap_err().to_string();
    assert!(
        e.contains("`general.architecture` holds a string, expected a non-negative integer"),
        "{e}"
    );
    let e = g.uint("x.neg").unwrap_err().to_string();
    assert!(e.contains("`x.neg` holds int32"), "{e}");
    let e = g.str("llama.name").unwrap_err().to_string();
    assert!(e.contains("metadata key `llama.name` is missing"), "{e}");
    let e = g.dequantize("nope").unwrap_err().to_string();
    assert!(e.contains("tensor `nope` is missing"), "{e}");
}

#[test]
fn every_truncation_is_an_error_naming_what_was_cut() {
    let bytes = sample().bytes();
    // Cut the file at every length short of the whole: each must fail cleanly, never panic.
    for len in 0..bytes.len() {
        let f = write(&bytes[..len]);
        let e = GgufFile::open(f.path()).unwrap_err();
        match e {
            GgufError::Truncated { .. }
            | GgufError::BadMagic { .. }
            | GgufError::Invalid { .. } => {}
            other => panic!("length {len}: unexpected error {other}"),
        }
    }
    // Cutting inside the last tensor's data names that tensor.
    let f = write(&bytes[..bytes.len() - 1]);
    let e = GgufFile::open(f.path()).unwrap_err().to_string();
    assert!(e.contains("truncated: tensor `v` (F16"), "{e}");
}

#[test]
fn bad_headers() {
    let mut bytes = sample().bytes();
    bytes[0] = b'X';
    let e = GgufFile::open(write(&bytes).path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a GGUF file"), "{e}");

    let mut bytes = sample().bytes();
    bytes[4] = 1;
    let e = GgufFile::open(write(&bytes).path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("GGUF version 1 is not supported"), "{e}");

    // A tensor count no file of this size can hold is refused before any allocation.
    let mut bytes = sample().bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::open(write(&bytes).path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than the file's"), "{e}");

    // So is an array longer than the rest of the file.
    let mut huge = 8u32.to_le_bytes().to_vec();
    huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let w = Writer::default().kv("tokenizer.ggml.tokens", 9, huge);
    let e = GgufFile::open(write(&w.bytes()).path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("metadata key `tokenizer.ggml.tokens`"), "{e}");
}

#[test]
fn unknown_types_are_named() {
    let w = Writer::default().kv("x", 13, vec![0; 8]);
    let e = GgufFile::open(write(&w.bytes()).path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("metadata key `x`: unknown value type 13"), "{e}");

    // A Q2_K tensor opens (its size is unknown to us, so the file is not refused) but cannot
    // be dequantised, and the error names the tensor and the type.
    let w = Writer::default().tensor("blk.0.attn_q.weight", &[256, 1], 10, vec![0; 84]);
    let g = GgufFile::open(write(&w.bytes()).path()).unwrap();
    let e = g.dequantize("blk.0.attn_q.weight").unwrap_err().to_string();
    assert!(
        e.contains("tensor `blk.0.attn_q.weight` is stored as Q2_K"),
        "{e}"
    );

    // Rows that are not whole blocks are refused.
    let w = Writer::default().tensor("t", &[31, 2], 8, vec![0; 68]);
    let e = GgufFile::open(write(&w.bytes()).path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor `t`: rows of 31 elements are not whole 32-element blocks of Q8_0"),
        "{e}"
    );

    // Offsets off the alignment are refused.
    let mut bytes = Writer::default().tensor("t", &[1], 0, vec![0; 4]).bytes();
    let name = gguf_string("t");
    let at = bytes
        .windows(name.len())
        .position(|w| w == name.as_slice())
        .unwrap();
    let off = at + name.len() + 4 + 8 + 4;
    bytes[off..off + 8].copy_from_slice(&3u64.to_le_bytes());
    let e = GgufFile::open(write(&bytes).path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data offset 3 is not a multiple of the alignment 32"),
        "{e}"
    );
}
