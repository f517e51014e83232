//! The server's settings, and the checks that make it fail closed.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TeacherError};

/// How the server behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Name reported by `/v1/models` and in OpenAI responses.
    pub model_name: String,
    /// Milliseconds the worker waits for more requests before running a partial batch.
    pub batch_wait_ms: u64,
    /// When set, requests must carry `Authorization: Bearer <key>` (compared in constant
    /// time). An empty key is refused ([`api_key_from_env`] reads one from the environment).
    pub api_key: Option<String>,
    /// Serve without a key on an address other than loopback. Off by default:
    /// [`spawn_server`](super::spawn_server) refuses such an address without a key, so that a forgotten key fails
    /// closed.
    pub allow_unauthenticated: bool,
    /// Most prompts in one request; more are refused with HTTP 400.
    pub max_prompts_per_request: usize,
    /// Most new tokens a request may ask for per prompt; more are refused with HTTP 400.
    pub max_new_tokens: usize,
    /// Largest request body in bytes; a larger one is refused with HTTP 400.
    pub max_body_bytes: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            model_name: "teacher".into(),
            batch_wait_ms: 5,
            api_key: None,
            allow_unauthenticated: false,
            max_prompts_per_request: 256,
            max_new_tokens: 8192,
            max_body_bytes: 16 << 20,
        }
    }
}

/// The API key in environment variable `name`: an error naming the variable when it is unset,
/// empty or not Unicode, so that a server started with a key option never serves without one.
pub fn api_key_from_env(name: &str) -> Result<String> {
    match std::env::var(name) {
        Ok(key) if !key.trim().is_empty() => Ok(key),
        Ok(_) => Err(TeacherError::Serve(format!(
            "the API key variable {name} is empty: set it to the key clients must send"
        ))),
        Err(std::env::VarError::NotPresent) => Err(TeacherError::Serve(format!(
            "the API key variable {name} is not set: export {name}=<key> (or drop the key \
             option to serve on loopback without one)"
        ))),
        Err(std::env::VarError::NotUnicode(_)) => Err(TeacherError::Serve(format!(
            "the API key variable {name} is not valid Unicode"
        ))),
    }
}

/// Refuses settings that would serve unprotected by accident: an empty key, or no key on an
/// address other than loopback without `allow_unauthenticated`.
pub(super) fn check_access(config: &ServeConfig, addr: SocketAddr) -> Result<()> {
    match &config.api_key {
        Some(k) if k.trim().is_empty() => Err(TeacherError::Serve(
            "the API key is empty: give a key, or none to serve on loopback only".into(),
        )),
        Some(_) => Ok(()),
        None if addr.ip().is_loopback() => Ok(()),
        None if config.allow_unauthenticated => {
            tracing::warn!(%addr, "serving without an API key on an address other than loopback");
            Ok(())
        }
        None => Err(TeacherError::Serve(format!(
            "{addr} is reachable from other machines and no API key is set: pass \
             --api_key_env NAME with the key in variable NAME, listen on 127.0.0.1, or pass \
             --allow_unauthenticated to serve without a key anyway"
        ))),
    }
}
