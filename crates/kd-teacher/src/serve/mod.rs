//! The local teacher over HTTP: SGLang's `POST /generate` and the OpenAI-compatible
//! `POST /v1/completions` (token-id prompts), plus `GET /health` and `GET /v1/models`, so that
//! a teacher can run on a GPU box and students elsewhere (through [`crate::RemoteTeacher`]
//! or any client of those APIs).
//!
//! Requests from all connections go to one worker thread that owns the model and batches
//! them (up to the teacher's batch size, waiting `batch_wait_ms` for company); a request gets
//! the tokens it would get alone (log-probs may differ in the last float bits, as a batch of
//! another composition sums in another order). Sampling seeds per request
//! (`sampling_seed` / `seed`) make sampled completions reproducible.
//!
//! Prompts are token ids, or text (SGLang's `text`, a string OpenAI `prompt`) when the
//! teacher has a tokenizer: encoded with its special tokens, as SGLang's
//! `tokenizer.encode(text)` and vLLM's default do.
//!
//! Supported request fields: see the SGLang and OpenAI request types; anything else is
//! refused with HTTP 400 naming the field, never silently ignored.

use std::sync::{Arc, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kd_data::ChatTokenizer;
use kd_model::FinishReason;
use tokio::sync::oneshot;

use crate::error::{Result, TeacherError};
use crate::local::LocalTeacher;
use crate::types::{SamplingParams, Scores};
use crate::wire::{
    OaiChoice, OaiLogprobs, OaiRequest, OaiResponse, OaiUsage, OneOrMany, PromptInput, SglFinish,
    SglHidden, SglLogprob, SglMeta, SglRequest, SglResponse, TextOrMany, token_key,
};

mod config;
mod handle;
mod worker;

pub use config::{ServeConfig, api_key_from_env};
pub use handle::{ServerHandle, spawn_server};
use worker::{Job, JobResult, worker};

#[derive(Clone)]
struct AppState {
    jobs: mpsc::Sender<Job>,
    config: ServeConfig,
    vocab: usize,
    /// The model's position limit: the longest prompt served.
    context: usize,
    /// Tokenizes text prompts (absent: token ids only).
    tokenizer: Option<Arc<ChatTokenizer>>,
}

/// An HTTP error in the OpenAI shape `{"error": {"message", "type", "code"}}`.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.0 {
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        };
        let body = serde_json::json!({
            "error": {"message": self.1, "type": kind, "code": self.0.as_u16()}
        });
        (self.0, Json(body)).into_response()
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

fn check_auth(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.config.api_key else {
        return Ok(());
    };
    use subtle::ConstantTimeEq;
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant time in the key's contents (a length mismatch returns at once).
    if given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes()))) {
        Ok(())
    } else {
        Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key (send `Authorization: Bearer <key>`)".into(),
        ))
    }
}

/// The prompts of a request as token ids, text tokenized by the served model's tokenizer
/// (with its special tokens, as SGLang and vLLM do); and whether a single prompt was given
/// (not a list).
async fn prompt_ids(
    state: &AppState,
    ids: Option<OneOrMany>,
    text: Option<TextOrMany>,
    fields: (&str, &str),
) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    let (ids_field, text_field) = fields;
    match (ids, text) {
        (Some(_), Some(_)) => Err(bad(format!(
            "give either `{ids_field}` or `{text_field}`, not both"
        ))),
        (None, None) => Err(bad(format!("give `{ids_field}` or `{text_field}`"))),
        (Some(ids), None) => {
            let single = matches!(ids, OneOrMany::One(_));
            Ok((ids.into_vec(), single))
        }
        (None, Some(text)) => {
            let Some(tokenizer) = state.tokenizer.clone() else {
                return Err(bad(format!(
                    "this server has no tokenizer (no tokenizer.json beside its model): send \
                     token ids in `{ids_field}`"
                )));
            };
            let (texts, single) = match text {
                TextOrMany::One(t) => (vec![t], true),
                TextOrMany::Many(t) => (t, false),
            };
            if texts.len() > state.config.max_prompts_per_request {
                // Refused before tokenizing them all.
                return Err(too_many(texts.len(), &state.config));
            }
            // Tokenizing is CPU work: off the async workers.
            let ids = tokio::task::spawn_blocking(move || {
                texts
                    .iter()
                    .map(|t| tokenizer.encode(t, true))
                    .collect::<std::result::Result<Vec<_>, _>>()
            })
            .await
            .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
            .map_err(|e| bad(format!("cannot tokenize `{text_field}`: {e}")))?;
            Ok((ids, single))
        }
    }
}

fn too_many(n: usize, limits: &ServeConfig) -> ApiError {
    bad(format!(
        "{n} prompts in one request; this server takes at most {} (split the request)",
        limits.max_prompts_per_request
    ))
}

/// Submits the prompts and waits for all of them.
async fn submit(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
    seed: u64,
    params: SamplingParams,
    top_k: Option<usize>,
    hidden: bool,
) -> Result<Vec<JobResult>, ApiError> {
    if prompts.is_empty() {
        return Err(bad("no prompt given"));
    }
    let limits = &state.config;
    if prompts.len() > limits.max_prompts_per_request {
        return Err(too_many(prompts.len(), limits));
    }
    if params.max_new_tokens > limits.max_new_tokens {
        return Err(bad(format!(
            "max_new_tokens {} is over this server's limit of {}",
            params.max_new_tokens, limits.max_new_tokens
        )));
    }
    if let Some((i, p)) = prompts
        .iter()
        .enumerate()
        .find(|(_, p)| p.len() > state.context)
    {
        return Err(bad(format!(
            "prompt {i} has {} tokens; the model's context is {} positions",
            p.len(),
            state.context
        )));
    }
    if params.max_new_tokens > 0 {
        params.validate().map_err(|e| bad(e.to_string()))?;
    }
    if let Some(k) = top_k
        && !(1..=state.vocab).contains(&k)
    {
        return Err(bad(format!(
            "top log-probs must lie in 1..={}, got {k}",
            state.vocab
        )));
    }
    let mut waits = Vec::with_capacity(prompts.len());
    for (i, ids) in prompts.into_iter().enumerate() {
        let (tx, rx) = oneshot::channel();
        let job = Job {
            ids,
            // Several prompts in one request: consecutive streams.
            seed: seed.wrapping_add(i as u64),
            params: params.clone(),
            top_k,
            hidden,
            reply: tx,
        };
        state
            .jobs
            .send(job)
            .map_err(|_| ApiError(StatusCode::SERVICE_UNAVAILABLE, "teacher stopped".into()))?;
        waits.push(rx);
    }
    let mut out = Vec::with_capacity(waits.len());
    for rx in waits {
        match rx.await {
            Ok(Ok(r)) => out.push(r),
            Ok(Err(e @ TeacherError::Input(_))) => return Err(bad(e.to_string())),
            Ok(Err(e)) => {
                return Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
            }
            Err(_) => {
                return Err(ApiError(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the teacher worker stopped".into(),
                ));
            }
        }
    }
    Ok(out)
}

/// SGLang's layout of the hidden states over prompt ++ output: the prompt's rows, then one
/// row per generated token but the last.
fn sgl_hidden(s: &Scores, plen: usize, generated: usize) -> Vec<SglHidden> {
    let h = &s.hidden_states[0];
    let row = |t: usize| h.values[t * h.dim..(t + 1) * h.dim].to_vec();
    let mut out = vec![SglHidden::Rows((0..plen).map(row).collect())];
    out.extend((plen..plen + generated.saturating_sub(1)).map(|t| SglHidden::Row(row(t))));
    out
}

fn top_row(s: &Scores, pos: usize) -> Vec<SglLogprob> {
    (0..s.k)
        .map(|j| {
            (
                Some(s.logprobs[pos * s.k + j]),
                s.indices[pos * s.k + j],
                None,
            )
        })
        .collect()
}

async fn sgl_generate(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: std::result::Result<Json<SglRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    check_auth(&state, &headers)?;
    let Json(req) = body.map_err(|e| bad(e.body_text()))?;
    if req.stream {
        return Err(bad("`stream` is not supported: send `stream: false`"));
    }
    let sp = &req.sampling_params;
    let params = SamplingParams {
        max_new_tokens: sp.max_new_tokens.unwrap_or(128),
        temperature: sp.temperature.unwrap_or(1.0),
        top_k: sp.top_k.filter(|k| *k > 0).unwrap_or(0) as usize,
        top_p: sp.top_p.unwrap_or(1.0),
        seed: 0,
        stop_token_ids: sp.stop_token_ids.clone().unwrap_or_default(),
        return_logprobs: req.return_logprob,
        hidden_layers: Vec::new(),
    };
    let top_k = (req.return_logprob && req.top_logprobs_num > 0).then_some(req.top_logprobs_num);
    let (prompts, single) =
        prompt_ids(&state, req.input_ids, req.text, ("input_ids", "text")).await?;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let results = submit(
        &state,
        prompts,
        sp.sampling_seed.unwrap_or(0),
        params,
        top_k,
        req.return_hidden_states,
    )
    .await?;
    let mut out = Vec::with_capacity(results.len());
    for (r, plen) in results.into_iter().zip(lens) {
        let g = r.generation;
        let n = g.ids.len();
        let (input_top, output_top) = match (&r.scores, req.logprob_start_len) {
            (Some(s), start) => {
                let input = (start >= 0).then(|| {
                    (start as usize..plen)
                        .map(|t| (t > 0).then(|| top_row(s, t - 1)))
                        .collect()
                });
                let output = (0..n).map(|j| Some(top_row(s, plen - 1 + j))).collect();
                (input, Some(output))
            }
            (None, _) => (None, None),
        };
        let meta = SglMeta {
            id: Some(format!("{:016x}", rand::random::<u64>())),
            finish_reason: Some(match g.finish_reason {
                FinishReason::Stop => SglFinish {
                    kind: "stop".into(),
                    matched: g.ids.last().map(|t| serde_json::json!(t)),
                    length: None,
                },
                FinishReason::Length => SglFinish {
                    kind: "length".into(),
                    matched: None,
                    length: Some(n),
                },
            }),
            prompt_tokens: plen,
            completion_tokens: n,
            output_token_logprobs: g.logprobs.as_ref().map(|lps| {
                lps.iter()
                    .zip(&g.ids)
                    .map(|(lp, id)| (Some(*lp), *id, None))
                    .collect()
            }),
            input_top_logprobs: input_top,
            output_top_logprobs: output_top,
            hidden_states: if req.return_hidden_states {
                r.scores.as_ref().map(|s| sgl_hidden(s, plen, n))
            } else {
                None
            },
        };
        out.push(SglResponse {
            text: g.text,
            output_ids: Some(g.ids),
            meta_info: meta,
        });
    }
    Ok(if single {
        Json(out.pop().expect("one result")).into_response()
    } else {
        Json(out).into_response()
    })
}

async fn oai_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: std::result::Result<Json<OaiRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    check_auth(&state, &headers)?;
    let Json(req) = body.map_err(|e| bad(e.body_text()))?;
    if req.stream {
        return Err(bad("`stream` is not supported: send `stream: false`"));
    }
    if req.n.unwrap_or(1) != 1 {
        return Err(bad("`n` must be 1"));
    }
    let params = SamplingParams {
        max_new_tokens: req.max_tokens.unwrap_or(16),
        temperature: req.temperature.unwrap_or(1.0),
        top_k: req.top_k.filter(|k| *k > 0).unwrap_or(0) as usize,
        top_p: req.top_p.unwrap_or(1.0),
        seed: 0,
        stop_token_ids: req.stop_token_ids.clone().unwrap_or_default(),
        return_logprobs: req.logprobs.is_some(),
        hidden_layers: Vec::new(),
    };
    let top_k = req.logprobs.filter(|k| *k > 0);
    let (ids, text) = match req.prompt {
        PromptInput::Ids(ids) => (Some(ids), None),
        PromptInput::Text(text) => (None, Some(text)),
    };
    let (prompts, _) = prompt_ids(&state, ids, text, ("prompt", "prompt")).await?;
    let prompt_ids = prompts.clone();
    let results = submit(&state, prompts, req.seed.unwrap_or(0), params, top_k, false).await?;
    let name = |id: u32| {
        if req.return_tokens_as_token_ids {
            token_key(id)
        } else {
            id.to_string()
        }
    };
    let top_map = |s: &Scores, pos: usize| {
        let mut m = serde_json::Map::new();
        for (lp, id, _) in top_row(s, pos) {
            m.insert(name(id), serde_json::json!(lp));
        }
        m
    };
    let mut choices = Vec::with_capacity(results.len());
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (i, (r, prompt)) in results.into_iter().zip(prompt_ids).enumerate() {
        let g = r.generation;
        prompt_tokens += prompt.len();
        completion_tokens += g.ids.len();
        let logprobs = g.logprobs.as_ref().map(|lps| {
            let plen = prompt.len();
            let (mut tokens, mut token_lps, mut tops) = (Vec::new(), Vec::new(), Vec::new());
            if req.echo {
                for (t, id) in prompt.iter().enumerate() {
                    tokens.push(name(*id));
                    // The log-prob of prompt token t is read from position t - 1's scores
                    // when it is among the top-k; otherwise unknown here.
                    let lp = match (&r.scores, t) {
                        (Some(s), t) if t > 0 => (0..s.k)
                            .find(|j| s.indices[(t - 1) * s.k + j] == *id)
                            .map(|j| s.logprobs[(t - 1) * s.k + j]),
                        _ => None,
                    };
                    token_lps.push(lp);
                    tops.push(match &r.scores {
                        Some(s) if t > 0 => Some(top_map(s, t - 1)),
                        _ => None,
                    });
                }
            }
            for (j, (id, lp)) in g.ids.iter().zip(lps).enumerate() {
                tokens.push(name(*id));
                token_lps.push(Some(*lp));
                tops.push(r.scores.as_ref().map(|s| top_map(s, plen - 1 + j)));
            }
            OaiLogprobs {
                text_offset: vec![0; tokens.len()],
                tokens,
                token_logprobs: token_lps,
                top_logprobs: r.scores.is_some().then_some(tops),
                content: None,
            }
        });
        choices.push(OaiChoice {
            index: i,
            text: g.text,
            finish_reason: Some(
                match g.finish_reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                }
                .into(),
            ),
            token_ids: req.return_token_ids.then(|| g.ids.clone()),
            prompt_token_ids: (req.return_token_ids && req.echo).then_some(prompt),
            logprobs,
        });
    }
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Json(OaiResponse {
        id: format!("cmpl-{:016x}", rand::random::<u64>()),
        object: "text_completion".into(),
        created,
        model: state.config.model_name.clone(),
        choices,
        usage: Some(OaiUsage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }),
    })
    .into_response())
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "object": "list",
        "data": [{"id": state.config.model_name, "object": "model", "owned_by": "kd"}]
    }))
}

/// The HTTP routes over `teacher`. The model moves to a worker thread that stops when the
/// router (all its clones) is dropped.
pub fn router(teacher: LocalTeacher, config: ServeConfig) -> Router {
    let (tx, rx) = mpsc::channel();
    let vocab = teacher.model().config().vocab_size;
    let context = teacher.model().config().max_position_embeddings;
    let tokenizer = teacher.shared_tokenizer();
    let wait = Duration::from_millis(config.batch_wait_ms);
    std::thread::Builder::new()
        .name("kd-teacher-worker".into())
        .spawn(move || worker(teacher, rx, wait))
        .expect("spawn the teacher worker");
    let body_limit = axum::extract::DefaultBodyLimit::max(config.max_body_bytes);
    let state = AppState {
        jobs: tx,
        config,
        vocab,
        context,
        tokenizer,
    };
    Router::new()
        .route("/generate", post(sgl_generate))
        .route("/v1/completions", post(oai_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .layer(body_limit)
        .with_state(state)
}
