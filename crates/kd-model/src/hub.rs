//! Hugging Face hub ids (`meta-llama/Llama-3.2-1B-Instruct`) resolved to a snapshot in the
//! local Hugging Face cache, offline, as transformers does with `HF_HUB_OFFLINE=1`.
//!
//! The cache is `huggingface_hub`'s layout: `<cache>/models--<org>--<name>/refs/<revision>`
//! holds a commit hash, `snapshots/<hash>/` the files (links into `blobs/`). The cache
//! directory is the first of `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE` (its older name),
//! `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub` and `~/.cache/huggingface/hub`, the
//! order `huggingface_hub` reads them in.

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// The Hugging Face cache directory models are looked up in (see the module docs).
pub fn hf_hub_cache() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// `org/name` or `org/name@revision` (a branch, tag or commit; default `main`) as
/// `(org, name, revision)`, as the hub spells ids; `None` for anything else (absolute paths,
/// `./x`, more than one slash, …).
pub fn parse_hub_id(spec: &str) -> Option<(&str, &str, &str)> {
    let (id, revision) = match spec.split_once('@') {
        Some((id, rev)) if !rev.is_empty() => (id, rev),
        Some(_) => return None,
        None => (spec, "main"),
    };
    let (org, name) = id.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (ok(org) && ok(name)).then_some((org, name, revision))
}

/// A model argument as a local path: an existing file or directory as it is; otherwise a hub
/// id (`org/name`, or `org/name@revision`) found in the Hugging Face cache
/// ([`hf_hub_cache`]) as its snapshot directory; otherwise the path unchanged (the loader
/// then says what is missing there). A hub id whose repository is in the cache but not at
/// that revision, or whose snapshot is gone, is an error that names what was looked for.
pub fn resolve_model_path(path: impl AsRef<Path>) -> Result<PathBuf> {
    resolve_in(path.as_ref(), hf_hub_cache().as_deref())
}

/// [`resolve_model_path`] with the cache directory given instead of read from the
/// environment.
pub fn resolve_model_path_in(path: impl AsRef<Path>, cache: impl AsRef<Path>) -> Result<PathBuf> {
    resolve_in(path.as_ref(), Some(cache.as_ref()))
}

fn resolve_in(path: &Path, cache: Option<&Path>) -> Result<PathBuf> {
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let (Some(spec), Some(cache)) = (path.to_str(), cache) else {
        return Ok(path.to_path_buf());
    };
    let Some((org, name, revision)) = parse_hub_id(spec) else {
        return Ok(path.to_path_buf());
    };
    let repo = cache.join(format!("models--{org}--{name}"));
    if !repo.is_dir() {
        return Ok(path.to_path_buf());
    }
    let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = if is_commit {
        revision.to_string()
    } else {
        let refs = repo.join("refs").join(revision);
        let text = std::fs::read_to_string(&refs).map_err(|e| ModelError::HubCache {
            id: spec.to_string(),
            message: format!(
                "the cache has {} but no revision `{revision}` ({}: {e})",
                repo.display(),
                refs.display()
            ),
        })?;
        text.trim().to_string()
    };
    let snapshot = repo.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        return Err(ModelError::HubCache {
            id: spec.to_string(),
            message: format!(
                "revision `{revision}` is commit {commit}, but {} is missing: download the \
                 model again (`huggingface-cli download {org}/{name}`)",
                snapshot.display()
            ),
        });
    }
    tracing::debug!(id = spec, snapshot = %snapshot.display(), "hub id found in the local cache");
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_told_from_paths() {
        assert_eq!(parse_hub_id("org/name"), Some(("org", "name", "main")));
        assert_eq!(
            parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@v1"),
            Some(("Qwen", "Qwen2.5-0.5B-Instruct", "v1"))
        );
        for not_an_id in ["name", "/abs/path", "./a/b", "a/b/c", "../x", "a/", "a/b@"] {
            assert_eq!(parse_hub_id(not_an_id), None, "{not_an_id}");
        }
    }

    #[test]
    fn the_cache_layout_is_read_and_gaps_are_named() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--org--m");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        let snap = repo.join("snapshots").join(commit);
        let got = |spec: &str| resolve_in(Path::new(spec), Some(cache.path()));
        assert_eq!(got("org/m").unwrap(), snap);
        assert_eq!(got(&format!("org/m@{commit}")).unwrap(), snap);
        // Not in the cache: unchanged, for the loader to report.
        assert_eq!(got("org/other").unwrap(), Path::new("org/other"));
        let e = got("org/m@dev").unwrap_err().to_string();
        assert!(
            e.contains("org/m@dev") && e.contains("no revision `dev`"),
            "{e}"
        );
        std::fs::write(repo.join("refs/main"), "f".repeat(40)).unwrap();
        let e = got("org/m").unwrap_err().to_string();
        assert!(
            e.contains("is missing") && e.contains("huggingface-cli download"),
            "{e}"
        );
    }
}
