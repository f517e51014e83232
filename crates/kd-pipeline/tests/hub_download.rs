//! Hub ids downloaded into the Hugging Face cache (feature `hub-download`), against a local
//! stand-in for the hub that answers as huggingface.co does (the revision API, `resolve/`
//! with `Range` requests, `ETag` and `X-Repo-Commit`): the files a model load reads land in
//! `huggingface_hub`'s layout, where the offline lookup then finds them, and nothing else is
//! fetched.
#![cfg(feature = "hub-download")]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kd_pipeline::hub::{DownloadObserver, Endpoint, download_model, download_model_with};

/// Records what a download reports.
#[derive(Default)]
struct Recorder {
    /// (file, index, files, announced bytes, bytes that arrived, finished)
    files: Vec<(String, usize, usize, u64, u64, bool)>,
}

impl DownloadObserver for Recorder {
    fn on_file(&mut self, _id: &str, file: &str, (index, files): (usize, usize), bytes: u64) {
        self.files
            .push((file.to_string(), index, files, bytes, 0, false));
    }
    fn on_bytes(&mut self, bytes: u64) {
        self.files.last_mut().unwrap().4 += bytes;
    }
    fn on_file_done(&mut self) {
        self.files.last_mut().unwrap().5 = true;
    }
}

const COMMIT: &str = "00112233445566778899aabbccddeeff00112233";

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-models/tiny-qwen3")
}

/// Answers one request; records its path.
fn answer(mut stream: TcpStream, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut range = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("range")
        {
            range = Some(v.trim().trim_start_matches("bytes=").to_string());
        }
    }
    log.lock().unwrap().push(path.clone());
    let respond =
        |stream: &mut TcpStream, status: &str, headers: &[(String, String)], body: &[u8]| {
            let mut head = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("\r\n");
            stream.write_all(head.as_bytes()).unwrap();
            stream.write_all(body).unwrap();
        };
    if path == "/api/models/tiny-org/tiny-qwen3/revision/main" {
        let body = serde_json::json!({
            "sha": COMMIT,
            "siblings": [
                {"rfilename": "config.json"},
                {"rfilename": "model.safetensors"},
                {"rfilename": "original/consolidated.pth"},
                {"rfilename": "README.md"},
            ]
        })
        .to_string();
        let headers = [("Content-Type".to_string(), "application/json".to_string())];
        return respond(&mut stream, "200 OK", &headers, body.as_bytes());
    }
    let Some(file) = path.strip_prefix("/tiny-org/tiny-qwen3/resolve/main/") else {
        return respond(&mut stream, "404 Not Found", &[], b"Repository not found");
    };
    let Ok(bytes) = std::fs::read(model_dir().join(file)) else {
        return respond(&mut stream, "404 Not Found", &[], b"Entry not found");
    };
    let start: usize = range
        .as_deref()
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let end = match range.as_deref() {
        Some(r) if !r.ends_with('-') => r.split('-').nth(1).unwrap().parse::<usize>().unwrap(),
        _ => bytes.len() - 1,
    };
    // A content hash as the ETag (the hub's is the git or LFS sha; any stable id works).
    let etag = format!(
        "{:016x}",
        bytes
            .iter()
            .fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(*b))
                .wrapping_mul(0x100000001b3))
    );
    let headers = [
        ("ETag".to_string(), format!("\"{etag}\"")),
        ("X-Repo-Commit".to_string(), COMMIT.to_string()),
        (
            "Content-Range".to_string(),
            format!("bytes {start}-{end}/{}", bytes.len()),
        ),
    ];
    respond(
        &mut stream,
        "206 Partial Content",
        &headers,
        &bytes[start..=end],
    );
}

/// A stand-in hub on a free local port; returns its URL and the paths it was asked for.
fn serve() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = log.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            answer(stream, &seen);
        }
    });
    (url, log)
}

#[test]
fn a_hub_id_is_downloaded_into_the_cache_layout_and_found_offline() {
    let (url, log) = serve();
    let cache = tempfile::tempdir().unwrap();
    let endpoint = Endpoint {
        url: Some(url),
        token: None,
    };
    let mut progress = Recorder::default();
    let snapshot = download_model_with(
        "tiny-org/tiny-qwen3",
        cache.path(),
        &endpoint,
        &mut progress,
    )
    .unwrap();
    // Progress: each fetched file announced with its size, its bytes counted, and finished.
    let names: Vec<&str> = progress.files.iter().map(|f| f.0.as_str()).collect();
    assert!(
        names.contains(&"config.json") && names.contains(&"model.safetensors"),
        "{names:?}"
    );
    for (i, (file, index, files, announced, arrived, done)) in progress.files.iter().enumerate() {
        let size = std::fs::metadata(model_dir().join(file)).unwrap().len();
        assert_eq!((*index, *files), (i, progress.files.len()), "{file}");
        assert_eq!((*announced, *arrived, *done), (size, size, true), "{file}");
    }
    let repo = cache.path().join("models--tiny-org--tiny-qwen3");
    assert_eq!(snapshot, repo.join("snapshots").join(COMMIT));
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main"))
            .unwrap()
            .trim(),
        COMMIT
    );
    // The files a load reads, byte for byte; not the other frameworks' weights or the README.
    for f in ["config.json", "model.safetensors"] {
        assert_eq!(
            std::fs::read(snapshot.join(f)).unwrap(),
            std::fs::read(model_dir().join(f)).unwrap(),
            "{f}"
        );
    }
    let asked = log.lock().unwrap().clone();
    assert!(
        asked
            .iter()
            .all(|p| !p.contains("original/") && !p.contains("README")),
        "{asked:?}"
    );
    // The offline lookup (what every later run does) finds the same snapshot.
    assert_eq!(
        kd_model::hub::resolve_model_path_in("tiny-org/tiny-qwen3", cache.path()).unwrap(),
        snapshot
    );
    let config = kd_model::LlamaConfig::from_file(snapshot.join("config.json")).unwrap();
    assert_eq!(config.family, kd_model::ModelFamily::Qwen3);

    // Asked again: the cached files are not downloaded again.
    let before = log.lock().unwrap().len();
    let mut progress = Recorder::default();
    download_model_with(
        "tiny-org/tiny-qwen3",
        cache.path(),
        &endpoint,
        &mut progress,
    )
    .unwrap();
    assert!(progress.files.is_empty(), "{:?}", progress.files);
    let again: Vec<String> = log.lock().unwrap()[before..].to_vec();
    assert!(
        again.iter().all(|p| p.starts_with("/api/")),
        "downloaded again: {again:?}"
    );

    // An id the hub does not have: an error that names it and says what to do.
    let e = download_model("tiny-org/absent", cache.path(), &endpoint)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tiny-org/absent") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
}
