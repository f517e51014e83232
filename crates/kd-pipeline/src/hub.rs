//! Hub ids the local Hugging Face cache lacks, downloaded into it (feature `hub-download`)
//! through the `hf-hub` crate, in `huggingface_hub`'s layout, so that the next run, and
//! transformers, find them offline.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hf_hub::api::Progress;
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::error::{PipelineError, Result};

/// Where and as whom to download: the hub's address (`HF_ENDPOINT`, default
/// `https://huggingface.co`) and an access token for gated models (`HF_TOKEN`, else the
/// token file `huggingface-cli login` writes beside the cache).
#[derive(Debug, Clone, Default)]
pub struct Endpoint {
    /// Base URL of the hub; `None` = `https://huggingface.co`.
    pub url: Option<String>,
    /// Bearer token; `None` = the cache's token file, if any.
    pub token: Option<String>,
}

impl Endpoint {
    /// `HF_ENDPOINT` and `HF_TOKEN` from the environment.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            url: var("HF_ENDPOINT"),
            token: var("HF_TOKEN"),
        }
    }
}

/// Progress of a download (a model can be many gigabytes): each file the cache lacks as it
/// starts, its bytes as they arrive, and its end. Every method has an empty default.
pub trait DownloadObserver: Send {
    /// File `index` (0-based) of the `files` to fetch of `id` starts: `bytes` long.
    fn on_file(&mut self, _id: &str, _file: &str, (_index, _files): (usize, usize), _bytes: u64) {}
    /// `bytes` more of the current file arrived.
    fn on_bytes(&mut self, _bytes: u64) {}
    /// The current file is complete.
    fn on_file_done(&mut self) {}
}

/// Reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoDownloadProgress;

impl DownloadObserver for NoDownloadProgress {}

static OBSERVER: Mutex<Option<Box<dyn DownloadObserver>>> = Mutex::new(None);

/// The observer of the downloads that resolving a model path starts anywhere in this process
/// ([`crate::models::local_model`], deep inside both pipelines): a binary sets its progress
/// display here once. Without one, downloads report nothing.
pub fn set_download_observer(observer: Box<dyn DownloadObserver>) {
    *OBSERVER.lock().unwrap_or_else(|p| p.into_inner()) = Some(observer);
}

/// hf-hub's progress callbacks, relayed to a [`DownloadObserver`].
struct Relay<'a> {
    observer: &'a mut dyn DownloadObserver,
    id: &'a str,
    index: usize,
    files: usize,
    /// hf-hub 0.4 calls `init` twice per file; the observer hears of it once.
    started: bool,
}

impl Progress for Relay<'_> {
    fn init(&mut self, size: usize, filename: &str) {
        if !self.started {
            self.started = true;
            self.observer
                .on_file(self.id, filename, (self.index, self.files), size as u64);
        }
    }

    fn update(&mut self, size: usize) {
        self.observer.on_bytes(size as u64);
    }

    fn finish(&mut self) {
        self.observer.on_file_done();
    }
}

/// Whether `HF_HUB_OFFLINE` asks for no network (`1`, `true`, `yes`, `on`), as
/// `huggingface_hub` reads it.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// Whether a repository file is one a model load reads: configuration and tokenizer files,
/// chat templates and safetensors weights at the repository's top level (not `original/`
/// checkpoints, other frameworks' weights or GGUF files).
fn wanted(file: &str) -> bool {
    !file.contains('/')
        && (file.ends_with(".json")
            || file.ends_with(".safetensors")
            || file.ends_with(".jinja")
            || file == "tokenizer.model")
}

/// Downloads the files a model load reads of the hub id `id` (`org/name[@revision]`) into
/// the Hugging Face cache `cache`, and returns its snapshot directory (what
/// [`kd_model::hub::resolve_model_path`] then finds offline). Files already in the cache at that
/// revision are not downloaded again. Progress goes to the observer
/// [`set_download_observer`] set, if any.
pub fn download_model(id: &str, cache: &Path, endpoint: &Endpoint) -> Result<PathBuf> {
    let mut global = OBSERVER.lock().unwrap_or_else(|p| p.into_inner());
    match global.as_deref_mut() {
        Some(observer) => download_model_with(id, cache, endpoint, observer),
        None => download_model_with(id, cache, endpoint, &mut NoDownloadProgress),
    }
}

/// [`download_model`], with progress told to `observer` (only the files the cache lacks).
pub fn download_model_with(
    id: &str,
    cache: &Path,
    endpoint: &Endpoint,
    observer: &mut dyn DownloadObserver,
) -> Result<PathBuf> {
    let err = |message: String| PipelineError::Download {
        id: id.to_string(),
        message,
    };
    let (org, name, revision) =
        kd_model::hub::parse_hub_id(id).ok_or_else(|| err("not a hub id (org/name)".into()))?;
    // Shown at the binaries' default level: a model can be many gigabytes.
    tracing::warn!(
        "{id} is not in the Hugging Face cache {}: downloading it from {} (HF_HUB_OFFLINE=1 \
         refuses downloads)",
        cache.display(),
        endpoint.url.as_deref().unwrap_or("https://huggingface.co")
    );
    let mut builder = ApiBuilder::new()
        .with_cache_dir(cache.to_path_buf())
        .with_progress(false)
        .with_retries(2);
    if let Some(url) = &endpoint.url {
        builder = builder.with_endpoint(url.clone());
    }
    if endpoint.token.is_some() {
        builder = builder.with_token(endpoint.token.clone());
    }
    let api = builder.build().map_err(|e| err(e.to_string()))?;
    let repo_id = Repo::with_revision(
        format!("{org}/{name}"),
        RepoType::Model,
        revision.to_string(),
    );
    let repo = api.repo(repo_id.clone());
    let info = repo.info().map_err(|e| {
        err(format!(
            "{e}; check the id and the network (HF_ENDPOINT), log in for gated models (HF_TOKEN), \
             or set HF_HUB_OFFLINE=1 and pass a local path"
        ))
    })?;
    let files: Vec<&str> = info
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .filter(|f| wanted(f))
        .collect();
    if !files.contains(&"config.json") {
        let ggufs: Vec<&str> = info
            .siblings
            .iter()
            .map(|s| s.rfilename.as_str())
            .filter(|f| f.ends_with(".gguf"))
            .collect();
        return Err(err(if ggufs.is_empty() {
            "the repository has no config.json: not a Hugging Face model".into()
        } else {
            format!(
                "the repository has no config.json but GGUF files {ggufs:?}: download the one \
                 you want and pass its path"
            )
        }));
    }
    let cached = Cache::new(cache.to_path_buf()).repo(repo_id);
    let missing: Vec<&str> = files
        .iter()
        .copied()
        .filter(|f| cached.get(f).is_none())
        .collect();
    let mut snapshot = None;
    for f in &files {
        let path = match missing.iter().position(|m| m == f) {
            None => repo.get(f),
            Some(index) => repo.download_with_progress(
                f,
                Relay {
                    observer: &mut *observer,
                    id,
                    index,
                    files: missing.len(),
                    started: false,
                },
            ),
        }
        .map_err(|e| err(format!("{f}: {e}")))?;
        if *f == "config.json" {
            snapshot = path.parent().map(Path::to_path_buf);
        }
    }
    let snapshot = snapshot.ok_or_else(|| err("config.json has no snapshot directory".into()))?;
    tracing::info!(id, files = files.len(), snapshot = %snapshot.display(), "downloaded");
    Ok(snapshot)
}
