//! `LoraConfig`: rank, alpha, dropout and target modules with PEFT's semantics.

use serde::{Deserialize, Serialize};

use crate::error::{LoraError, Result};

/// Which modules get adapters, as PEFT's `target_modules`: a list of names (a module matches
/// when its full path equals a name or ends with `.name`), or one regular expression that
/// must match the full module path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Module names (`["q_proj", "v_proj"]`).
    Names(Vec<String>),
    /// A regular expression over full module paths (`".*\\.(q|v)_proj"`).
    Regex(String),
}

impl Default for TargetModules {
    fn default() -> Self {
        Self::Names(
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            .map(String::from)
            .to_vec(),
        )
    }
}

/// A compiled [`TargetModules`].
#[derive(Debug, Clone)]
pub struct TargetMatcher {
    names: Vec<String>,
    regex: Option<regex::Regex>,
}

impl TargetMatcher {
    /// Whether the module at `path` (`model.layers.0.self_attn.q_proj`) is a target.
    pub fn matches(&self, path: &str) -> bool {
        match &self.regex {
            Some(re) => re.is_match(path),
            None => self
                .names
                .iter()
                .any(|n| path == n || path.ends_with(&format!(".{n}"))),
        }
    }

    /// Checks the targets against the modules that can take an adapter: every name must
    /// match at least one module (PEFT raises for targets that match nothing).
    pub fn check(&self, available: &[String]) -> Result<Vec<String>> {
        let selected: Vec<String> = available
            .iter()
            .filter(|p| self.matches(p))
            .cloned()
            .collect();
        let unknown: Vec<&String> = self
            .names
            .iter()
            .filter(|n| {
                !available
                    .iter()
                    .any(|p| *p == **n || p.ends_with(&format!(".{n}")))
            })
            .collect();
        if !unknown.is_empty() || selected.is_empty() {
            let mut valid: Vec<String> = available
                .iter()
                .map(|p| p.rsplit('.').next().unwrap_or(p).to_string())
                .collect();
            valid.sort();
            valid.dedup();
            let what = if unknown.is_empty() {
                "the target_modules pattern matches no module".to_string()
            } else {
                format!(
                    "unknown target module(s) {}",
                    unknown
                        .iter()
                        .map(|u| format!("`{u}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            return Err(LoraError::Config(format!(
                "{what}; valid module names: {}",
                valid.join(", ")
            )));
        }
        Ok(selected)
    }
}

/// LoRA hyper-parameters (defaults: the speculator seed's r 64, α 128, dropout 0.05 on all
/// attention and MLP projections).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Rank.
    pub r: usize,
    /// Scaling numerator: scale = α / r (α / √r with rsLoRA).
    pub alpha: f64,
    /// Dropout on the adapter input during training.
    pub dropout: f64,
    /// Modules that get adapters.
    pub target_modules: TargetModules,
    /// Rank-stabilised scaling (Kalajdzievski 2023).
    pub use_rslora: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: 64,
            alpha: 128.0,
            dropout: 0.05,
            target_modules: TargetModules::default(),
            use_rslora: false,
        }
    }
}

impl LoraConfig {
    /// The factor on the adapter output.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Checks ranges and compiles the target matcher.
    pub fn matcher(&self) -> Result<TargetMatcher> {
        if self.r == 0 {
            return Err(LoraError::Config("`r` must be positive".into()));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(LoraError::Config(format!(
                "`dropout` must lie in [0, 1), got {}",
                self.dropout
            )));
        }
        Ok(match &self.target_modules {
            TargetModules::Names(names) => TargetMatcher {
                names: names.clone(),
                regex: None,
            },
            TargetModules::Regex(re) => TargetMatcher {
                names: Vec::new(),
                regex: Some(regex::Regex::new(&format!("^(?:{re})$")).map_err(|e| {
                    LoraError::Config(format!("`target_modules` regex {re:?}: {e}"))
                })?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths() -> Vec<String> {
        (0..2)
            .flat_map(|l| {
                ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"]
                    .map(|m| format!("model.layers.{l}.{m}"))
            })
            .collect()
    }

    #[test]
    fn names_and_regexes_as_peft() {
        let c = LoraConfig {
            target_modules: TargetModules::Names(vec!["q_proj".into()]),
            ..LoraConfig::default()
        };
        assert_eq!(c.matcher().unwrap().check(&paths()).unwrap().len(), 2);
        let c = LoraConfig {
            target_modules: TargetModules::Regex(r"model\.layers\.1\..*_proj".into()),
            ..LoraConfig::default()
        };
        let sel = c.matcher().unwrap().check(&paths()).unwrap();
        assert_eq!(sel.len(), 3);
        assert!(sel.iter().all(|p| p.starts_with("model.layers.1.")));
        // A regex must match the whole path.
        let c = LoraConfig {
            target_modules: TargetModules::Regex("q_proj".into()),
            ..LoraConfig::default()
        };
        assert!(c.matcher().unwrap().check(&paths()).is_err());
    }

    #[test]
    fn unknown_names_list_valid_ones() {
        let c = LoraConfig {
            target_modules: TargetModules::Names(vec!["q_proj".into(), "qkv".into()]),
            ..LoraConfig::default()
        };
        let e = c
            .matcher()
            .unwrap()
            .check(&paths())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`qkv`") && e.contains("down_proj, k_proj, q_proj"),
            "{e}"
        );
    }

    #[test]
    fn scaling_and_serde() {
        let c = LoraConfig::default();
        assert_eq!(c.scaling(), 2.0);
        assert_eq!(
            LoraConfig {
                use_rslora: true,
                ..c.clone()
            }
            .scaling(),
            16.0
        );
        let c: LoraConfig =
            serde_json::from_str(r#"{"r": 8, "target_modules": "model\\..*"}"#).unwrap();
        assert_eq!(c.target_modules, TargetModules::Regex("model\\..*".into()));
        assert!(serde_json::from_str::<LoraConfig>(r#"{"rank": 8}"#).is_err());
    }
}
