//! A teacher on another machine: SGLang's native `/generate`, an OpenAI-compatible
//! `/v1/completions` server (vLLM, SGLang, llama.cpp's `llama-server`, or
//! [`crate::spawn_server`]), or llama.cpp's native `/completion`.
//!
//! llama.cpp's server generates but cannot score: it returns log-probabilities of generated
//! tokens only, never of prompt tokens, so `score` through it is an error that says so (use
//! a local teacher, SGLang or vLLM for scoring).
//!
//! One request per prompt, at most `max_concurrency` in flight; each request has a timeout
//! and is retried on connection errors, timeouts, HTTP 429 and 5xx with exponential backoff
//! and full jitter. Results are kept by prompt position, so a retried request can neither
//! lose nor duplicate a prompt. Responses are validated (lengths, vocabulary, finish
//! reasons) and a mismatch is an error naming the prompt and what is wrong.

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::error::{Result, TeacherError};
use crate::local::{Prompt, Teacher, stream_seed};
use crate::types::{Generation, LAST_HIDDEN_LAYER, SamplingParams, ScoreOptions, Scores};
mod parse;

use crate::wire::{OaiRequest, SglRequest, SglSampling};
use parse::{
    LLAMACPP_CANNOT_SCORE, describe, parse_llamacpp_generation, parse_oai_generation,
    parse_oai_scores, parse_sgl_generation, parse_sgl_scores,
};

/// Which HTTP API the server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoteApi {
    /// SGLang's native `POST /generate`.
    Sglang,
    /// `POST /v1/completions` with token-id prompts (vLLM, SGLang; llama.cpp's server for
    /// generation only). The generated ids are read from `token_ids` (vLLM's
    /// `return_token_ids`), `logprobs.tokens` as ids (`return_tokens_as_token_ids`) or
    /// `logprobs.content[].id` (llama.cpp); a reply with none of them is an error.
    Openai,
    /// llama.cpp's native `POST /completion` with `return_tokens` (generation only: the
    /// server has no prompt log-probabilities to score with).
    Llamacpp,
}

/// Where the remote teacher is and how to talk to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteConfig {
    /// Base URL, e.g. `http://gpu-box:30000` (without `/generate` or `/v1`).
    pub url: String,
    /// The API.
    pub api: RemoteApi,
    /// `model` field of OpenAI requests (the served model's name).
    pub model: Option<String>,
    /// Identifies the teacher's weights in cache keys (e.g. the model path on the server);
    /// defaults to the API, URL and model name.
    pub fingerprint: Option<String>,
    /// Vocabulary size of the student/tokenizer: returned ids at or beyond it are an error.
    pub vocab_size: Option<usize>,
    /// Requests in flight at most.
    pub max_concurrency: usize,
    /// Seconds one request may take (generation of a whole completion).
    pub request_timeout_s: f64,
    /// Seconds to establish a connection.
    pub connect_timeout_s: f64,
    /// Retries of one request after the first attempt.
    pub max_retries: u32,
    /// First backoff in seconds; doubles per retry, capped by `max_backoff_s`; the actual
    /// wait is uniform in [0, backoff] (full jitter).
    pub initial_backoff_s: f64,
    /// Cap of the backoff in seconds.
    pub max_backoff_s: f64,
    /// Environment variable holding the API key (sent as `Authorization: Bearer`).
    pub api_key_env: String,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:30000".into(),
            api: RemoteApi::Sglang,
            model: None,
            fingerprint: None,
            vocab_size: None,
            max_concurrency: 32,
            request_timeout_s: 600.0,
            connect_timeout_s: 10.0,
            max_retries: 6,
            initial_backoff_s: 0.5,
            max_backoff_s: 30.0,
            api_key_env: "OPENAI_API_KEY".into(),
        }
    }
}

impl RemoteConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(TeacherError::Config(m.into()));
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return bad("remote teacher `url` must start with http:// or https://");
        }
        if self.max_concurrency == 0 {
            return bad("`max_concurrency` must be positive");
        }
        for (name, v) in [
            ("request_timeout_s", self.request_timeout_s),
            ("connect_timeout_s", self.connect_timeout_s),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(TeacherError::Config(format!("`{name}` must be positive")));
            }
        }
        if !(self.initial_backoff_s >= 0.0 && self.max_backoff_s >= self.initial_backoff_s) {
            return bad("backoffs must satisfy 0 ≤ initial_backoff_s ≤ max_backoff_s");
        }
        Ok(())
    }
}

struct Inner {
    config: RemoteConfig,
    client: reqwest::Client,
    api_key: Option<String>,
}

/// A teacher behind an HTTP API.
///
/// The [`Teacher`] methods block on an internal runtime; from async code use
/// [`RemoteTeacher::generate_async`] and [`RemoteTeacher::score_async`].
pub struct RemoteTeacher {
    inner: Arc<Inner>,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for RemoteTeacher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTeacher")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl RemoteTeacher {
    /// A client for `config` (the API key is read from `config.api_key_env` if set there).
    pub fn new(config: RemoteConfig) -> Result<Self> {
        let key = std::env::var(&config.api_key_env)
            .ok()
            .filter(|k| !k.is_empty());
        Self::with_api_key(config, key)
    }

    /// A client with an explicit API key (`None`: no `Authorization` header).
    pub fn with_api_key(mut config: RemoteConfig, api_key: Option<String>) -> Result<Self> {
        config.validate()?;
        config.url = config.url.trim_end_matches('/').to_string();
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs_f64(config.connect_timeout_s))
            .build()
            .map_err(|e| TeacherError::Config(format!("cannot build the HTTP client: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| TeacherError::Config(format!("cannot start the HTTP runtime: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                client,
                api_key,
            }),
            runtime,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RemoteConfig {
        &self.inner.config
    }

    /// [`Teacher::generate`] for async callers.
    pub async fn generate_async(
        &self,
        prompts: &[Prompt],
        params: &SamplingParams,
    ) -> Result<Vec<Generation>> {
        params.validate()?;
        if !params.hidden_layers.is_empty() {
            return Err(TeacherError::Config(
                "hidden states are not fetched from remote teachers yet: leave \
                 `hidden_layers` empty, or use a local teacher"
                    .into(),
            ));
        }
        for p in prompts {
            if p.ids.is_empty() {
                return Err(TeacherError::Input(format!("prompt {} is empty", p.index)));
            }
        }
        let jobs = prompts
            .iter()
            .map(|p| {
                let inner = self.inner.clone();
                let (ids, index, params) = (p.ids.clone(), p.index, params.clone());
                async move { inner.generate_one(ids, index, &params).await }
            })
            .collect();
        run_bounded(self.inner.config.max_concurrency, jobs).await
    }

    /// [`Teacher::score`] for async callers.
    pub async fn score_async(&self, sequences: &[Vec<u32>], k: usize) -> Result<Vec<Scores>> {
        self.score_with_async(sequences, &ScoreOptions::top_k(k))
            .await
    }

    /// [`Teacher::score_with`] for async callers. Hidden states come from SGLang's native
    /// API only (`return_hidden_states`; the server must run with
    /// `--enable-return-hidden-states`), and only the last layer's, after the final norm:
    /// ask for [`LAST_HIDDEN_LAYER`].
    pub async fn score_with_async(
        &self,
        sequences: &[Vec<u32>],
        options: &ScoreOptions,
    ) -> Result<Vec<Scores>> {
        let k = options.top_k;
        if k == 0 {
            return Err(TeacherError::Config("top-k must be positive".into()));
        }
        let hidden = match options.hidden_layers.as_slice() {
            [] => false,
            [LAST_HIDDEN_LAYER] if self.inner.config.api == RemoteApi::Sglang => true,
            [LAST_HIDDEN_LAYER] => {
                return Err(TeacherError::Config(
                    "hidden states over a whole sequence come only from SGLang's native API \
                     (`/generate` with `return_hidden_states`); the OpenAI API returns the last \
                     position's only: use the sglang API"
                        .into(),
                ));
            }
            other => {
                return Err(TeacherError::Config(format!(
                    "a remote teacher returns the last layer's hidden states only (after the \
                     final norm: LAST_HIDDEN_LAYER), not layers {other:?}"
                )));
            }
        };
        for (i, s) in sequences.iter().enumerate() {
            if s.is_empty() {
                return Err(TeacherError::Input(format!("sequence {i} is empty")));
            }
        }
        let jobs = sequences
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let inner = self.inner.clone();
                let ids = s.clone();
                async move { inner.score_one(ids, i, k, hidden).await }
            })
            .collect();
        run_bounded(self.inner.config.max_concurrency, jobs).await
    }
}

/// Runs the jobs with at most `limit` in flight; results in input order, the first error
/// stops the whole call.
async fn run_bounded<T, F>(limit: usize, jobs: Vec<F>) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T>> + Send + 'static,
{
    let sem = Arc::new(Semaphore::new(limit));
    let mut set = tokio::task::JoinSet::new();
    let n = jobs.len();
    for (i, job) in jobs.into_iter().enumerate() {
        let sem = sem.clone();
        set.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore open");
            (i, job.await)
        });
    }
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    while let Some(joined) = set.join_next().await {
        let (i, r) = joined.map_err(|e| TeacherError::Remote {
            url: String::new(),
            message: format!("request task failed: {e}"),
        })?;
        out[i] = Some(r?);
    }
    Ok(out
        .into_iter()
        .map(|r| r.expect("every request completed"))
        .collect())
}

impl Inner {
    fn endpoint(&self) -> String {
        match self.config.api {
            RemoteApi::Sglang => format!("{}/generate", self.config.url),
            RemoteApi::Openai => format!("{}/v1/completions", self.config.url),
            RemoteApi::Llamacpp => format!("{}/completion", self.config.url),
        }
    }

    fn protocol(&self, what: &str, message: impl std::fmt::Display) -> TeacherError {
        TeacherError::Protocol {
            url: self.endpoint(),
            message: format!("{what}: {message}"),
        }
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let c = &self.config;
        let cap = (c.initial_backoff_s * 2f64.powi(attempt.min(30) as i32)).min(c.max_backoff_s);
        Duration::from_secs_f64(rand::rng().random_range(0.0..=cap.max(0.0)))
    }

    /// POSTs `body`, retrying transient failures; returns the response body.
    async fn post(&self, body: &serde_json::Value, what: &str) -> Result<Vec<u8>> {
        let url = self.endpoint();
        let timeout = Duration::from_secs_f64(self.config.request_timeout_s);
        let mut last = String::new();
        for attempt in 0..=self.config.max_retries {
            if attempt > 0 {
                let wait = self.backoff(attempt - 1);
                tracing::warn!(%url, what, attempt, error = %last, ?wait, "retrying teacher request");
                tokio::time::sleep(wait).await;
            }
            let mut req = self.client.post(&url).json(body).timeout(timeout);
            if let Some(key) = &self.api_key {
                req = req.bearer_auth(key);
            }
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    match resp.bytes().await {
                        Ok(bytes) if status.is_success() => return Ok(bytes.to_vec()),
                        Ok(bytes) => {
                            let text = String::from_utf8_lossy(&bytes);
                            let text: String = text.chars().take(500).collect();
                            last = format!("HTTP {status}: {text}");
                            if !(status.is_server_error() || status.as_u16() == 429) {
                                return Err(TeacherError::Remote {
                                    url,
                                    message: format!("{what} was refused: {last}"),
                                });
                            }
                        }
                        Err(e) => last = format!("HTTP {status}, body cut off: {e}"),
                    }
                }
                Err(e) if e.is_builder() => {
                    return Err(TeacherError::Remote {
                        url,
                        message: format!("{what}: cannot build the request: {e}"),
                    });
                }
                Err(e) => last = describe(&e),
            }
        }
        Err(TeacherError::Remote {
            url: url.clone(),
            message: format!(
                "{what} failed {} times, last: {last}; check that the server is up \
                 (e.g. `curl {}/health`) and reachable from here",
                self.config.max_retries + 1,
                self.config.url
            ),
        })
    }

    fn check_vocab(&self, ids: impl IntoIterator<Item = u32>, what: &str) -> Result<()> {
        if let Some(v) = self.config.vocab_size
            && let Some(bad) = ids.into_iter().find(|t| *t as usize >= v)
        {
            return Err(self.protocol(
                what,
                format!(
                    "the server returned token {bad}, beyond the vocabulary of {v}: the served \
                     model and the tokenizer do not match"
                ),
            ));
        }
        Ok(())
    }

    async fn generate_one(
        &self,
        ids: Vec<u32>,
        index: u64,
        params: &SamplingParams,
    ) -> Result<Generation> {
        let what = format!("prompt {index}");
        let seed = stream_seed(params.seed, index);
        let stop = (!params.stop_token_ids.is_empty()).then(|| params.stop_token_ids.clone());
        let body = match self.config.api {
            RemoteApi::Sglang => serde_json::to_value(SglRequest {
                return_logprob: params.return_logprobs,
                ..SglRequest::new(
                    ids,
                    SglSampling {
                        max_new_tokens: Some(params.max_new_tokens),
                        temperature: Some(params.temperature),
                        top_k: Some(if params.top_k == 0 {
                            -1
                        } else {
                            params.top_k as i64
                        }),
                        top_p: Some(params.top_p),
                        stop_token_ids: stop,
                        sampling_seed: Some(seed),
                    },
                )
            }),
            RemoteApi::Openai => serde_json::to_value(OaiRequest {
                max_tokens: Some(params.max_new_tokens),
                temperature: Some(params.temperature),
                top_p: Some(params.top_p),
                top_k: (params.top_k > 0).then_some(params.top_k as i64),
                seed: Some(seed),
                stop_token_ids: stop,
                logprobs: Some(1),
                return_token_ids: true,
                ..OaiRequest::new(self.config.model.clone(), ids)
            }),
            RemoteApi::Llamacpp => Ok(serde_json::json!({
                "prompt": ids,
                "n_predict": params.max_new_tokens,
                // llama.cpp samples greedily at temperature ≤ 0; top_k 0 disables top-k.
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
                "min_p": 0.0,
                "seed": seed as u32,
                "return_tokens": true,
                "n_probs": usize::from(params.return_logprobs),
                "cache_prompt": true,
                "stream": false,
            })),
        }
        .expect("serialisable");
        let bytes = self.post(&body, &what).await?;
        let g = match self.config.api {
            RemoteApi::Sglang => parse_sgl_generation(&bytes, params.return_logprobs),
            RemoteApi::Openai => parse_oai_generation(&bytes, params.return_logprobs),
            RemoteApi::Llamacpp => {
                parse_llamacpp_generation(&bytes, params.return_logprobs, &params.stop_token_ids)
            }
        }
        .map_err(|m| self.protocol(&what, m))?;
        if g.ids.len() > params.max_new_tokens {
            return Err(self.protocol(
                &what,
                format!(
                    "{} tokens returned, more than max_new_tokens = {}",
                    g.ids.len(),
                    params.max_new_tokens
                ),
            ));
        }
        self.check_vocab(g.ids.iter().copied(), &what)?;
        Ok(g)
    }

    async fn score_one(
        &self,
        ids: Vec<u32>,
        index: usize,
        k: usize,
        hidden: bool,
    ) -> Result<Scores> {
        let what = format!("sequence {index}");
        if self.config.api == RemoteApi::Llamacpp {
            return Err(self.protocol(&what, LLAMACPP_CANNOT_SCORE));
        }
        let len = ids.len();
        // One generated token, so that the last position's distribution comes back too.
        let body = match self.config.api {
            RemoteApi::Sglang => serde_json::to_value(SglRequest {
                return_logprob: true,
                logprob_start_len: 0,
                top_logprobs_num: k,
                return_hidden_states: hidden,
                ..SglRequest::new(
                    ids,
                    SglSampling {
                        max_new_tokens: Some(1),
                        temperature: Some(0.0),
                        ..SglSampling::default()
                    },
                )
            }),
            RemoteApi::Openai => serde_json::to_value(OaiRequest {
                max_tokens: Some(1),
                temperature: Some(0.0),
                logprobs: Some(k),
                echo: true,
                ..OaiRequest::new(self.config.model.clone(), ids)
            }),
            RemoteApi::Llamacpp => unreachable!("refused above"),
        }
        .expect("serialisable");
        let bytes = self.post(&body, &what).await?;
        let s = match self.config.api {
            RemoteApi::Sglang => parse_sgl_scores(&bytes, len, k, hidden),
            RemoteApi::Openai => parse_oai_scores(&bytes, len, k),
            RemoteApi::Llamacpp => unreachable!("refused above"),
        }
        .map_err(|m| self.protocol(&what, m))?;
        self.check_vocab(s.indices.iter().copied(), &what)?;
        Ok(s)
    }
}

impl Teacher for RemoteTeacher {
    fn generate(&self, prompts: &[Prompt], params: &SamplingParams) -> Result<Vec<Generation>> {
        self.runtime.block_on(self.generate_async(prompts, params))
    }

    fn score_with(&self, sequences: &[Vec<u32>], options: &ScoreOptions) -> Result<Vec<Scores>> {
        self.runtime
            .block_on(self.score_with_async(sequences, options))
    }

    fn fingerprint(&self) -> String {
        let c = &self.inner.config;
        c.fingerprint.clone().unwrap_or_else(|| {
            format!(
                "remote {:?} {} {}",
                c.api,
                c.url,
                c.model.as_deref().unwrap_or("")
            )
        })
    }
}
