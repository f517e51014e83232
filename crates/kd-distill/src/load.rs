//! Loading a distill configuration as ROLL users write it: a YAML file (`--config_path DIR
//! --config_name NAME` or `--config FILE`), Hydra-style overrides (`key.sub=value`, `+key=value`
//! adds, `++key=value` adds or replaces, `~key` removes), OmegaConf interpolations
//! (`${key.path}`, `${oc.env:VAR,default}`), then every key checked:
//!
//! - a key this toolkit uses is parsed (a wrong type is an error naming the key path and what
//!   was expected);
//! - a key ROLL accepts that has no meaning here (`strategy_args`, `system_envs`, …) gets one
//!   warning naming it and is ignored;
//! - a key that exists in neither is an error naming the nearest valid key (ROLL silently
//!   ignores typos; we do not).
//!
//! TRL's `GKDConfig` names are accepted at the top level as aliases: `lmbda` (the share of
//! on-policy rows) is `on_policy_ratio`; `beta` (the generalised JSD's interpolation) selects
//! `kd_objective` — 0 is `forward_kl`, 0.5 `js_divergence`, 1 `reverse_kl` (other values have
//! no objective here: an error says so); `seq_kd: false` is the default and `seq_kd: true`
//! (training on the teacher's generations) is refused with the pipeline that does it.

use std::path::{Path, PathBuf};

use serde_yaml::{Mapping, Value};

use super::config::{DistillConfig, WorkerConfig};
use super::roll_keys;
use crate::error::{PipelineError, Result};

/// A configuration with what loading it noticed.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    /// The configuration.
    pub config: DistillConfig,
    /// Keys ignored and other notes, one line each.
    pub warnings: Vec<String>,
    /// The file it came from.
    pub source: Option<PathBuf>,
}

/// The YAML file named by ROLL's `--config_path DIR --config_name NAME` (`NAME` with or
/// without `.yaml`).
pub fn config_file(config_path: &Path, config_name: &str) -> PathBuf {
    let name = if config_name.ends_with(".yaml") || config_name.ends_with(".yml") {
        config_name.to_string()
    } else {
        format!("{config_name}.yaml")
    };
    config_path.join(name)
}

/// Loads `file` (when given), applies `overrides`, resolves interpolations and checks every
/// key (see the module docs).
pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<LoadedConfig> {
    let origin = file
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "configuration".into());
    let err = |m: String| PipelineError::Config(format!("{origin}: {m}"));
    let mut root = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| PipelineError::io(path, e))?;
            if text.trim().is_empty() {
                Value::Mapping(Mapping::new())
            } else {
                serde_yaml::from_str::<Value>(&text)
                    .map_err(|e| err(format!("invalid YAML: {e}")))?
            }
        }
        None => Value::Mapping(Mapping::new()),
    };
    if !root.is_mapping() {
        return Err(err("expected a mapping of keys to values at the top".into()));
    }
    let mut warnings = Vec::new();
    // Hydra's composition list: nothing to compose here.
    if let Some(defaults) = root.as_mapping_mut().and_then(|m| m.remove("defaults")) {
        let entries: Vec<String> = match &defaults {
            Value::Sequence(s) => s.iter().map(yaml_text).collect(),
            other => vec![yaml_text(other)],
        };
        let entries: Vec<String> = entries.into_iter().filter(|e| e != "_self_").collect();
        if !entries.is_empty() {
            warnings.push(format!(
                "Hydra `defaults` entries are not composed here and are ignored: {}",
                entries.join(", ")
            ));
        }
    }
    // Hydra's own settings (run directory, output subdirectory): Hydra consumes them.
    if let Some(hydra) = root.as_mapping_mut().and_then(|m| m.remove("hydra"))
        && !hydra.is_null()
    {
        warnings.push("`hydra` (Hydra's run settings) has no meaning here and is ignored".into());
    }
    let schema = Section::top();
    for o in overrides {
        apply_override(&mut root, o, &schema).map_err(|m| err(format!("override `{o}`: {m}")))?;
    }
    // Interpolations see the file's keys over the defaults (as OmegaConf over a structured
    // config).
    let mut resolver = serde_yaml::to_value(DistillConfig::default()).expect("defaults serialise");
    merge(&mut resolver, &root);
    let mut kept = root;
    // Both `max_grad_norm`s set: the top level wins.
    let top_clip = get(&kept, &["max_grad_norm"]).cloned();
    if let Some(top) = top_clip {
        if get(&kept, &["student", "training_args", "max_grad_norm"]).is_some() {
            warnings.push(
                "`max_grad_norm` is set at the top level and in `student.training_args`: the \
                 top level wins"
                    .into(),
            );
        }
        set(
            &mut kept,
            &["student", "training_args", "max_grad_norm"],
            top,
        );
    }
    trl_aliases(&mut kept).map_err(err)?;
    check_keys(&mut kept, &schema, "", &mut warnings).map_err(err)?;
    resolve(&mut kept, &resolver, "", 0).map_err(err)?;
    let text = serde_yaml::to_string(&kept).expect("a YAML value serialises");
    let de = serde_yaml::Deserializer::from_str(&text);
    let config: DistillConfig = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        err(format!("`{path}`: {}", e.into_inner()))
    })?;
    Ok(LoadedConfig {
        config,
        warnings,
        source: file.map(Path::to_path_buf),
    })
}

/// Rewrites TRL's `GKDConfig` names (`lmbda`, `beta`, `seq_kd`) into this pipeline's keys.
fn trl_aliases(root: &mut Value) -> std::result::Result<(), String> {
    let Some(map) = root.as_mapping_mut() else {
        return Ok(());
    };
    if let Some(v) = map.remove("lmbda") {
        if map.contains_key("on_policy_ratio") {
            return Err(
                "`lmbda` (TRL's name) and `on_policy_ratio` are the same setting: give one".into(),
            );
        }
        map.insert("on_policy_ratio".into(), v);
    }
    if let Some(v) = map.remove("beta") {
        if map.contains_key("kd_objective") {
            return Err(
                "`beta` (TRL's generalised-JSD interpolation) chooses `kd_objective`: \
                        give one of them"
                    .into(),
            );
        }
        let beta = v
            .as_f64()
            .ok_or_else(|| format!("`beta`: expected a number, got {}", yaml_text(&v)))?;
        let objective = if beta == 0.0 {
            "forward_kl"
        } else if beta == 0.5 {
            "js_divergence"
        } else if beta == 1.0 {
            "reverse_kl"
        } else {
            return Err(format!(
                "`beta: {beta}`: TRL's generalised JSD is implemented here for β = 0 \
                 (forward_kl), 0.5 (js_divergence) and 1 (reverse_kl); for another mixture use \
                 `kd_objective: skewed_forward_kl` or `skewed_reverse_kl` with `skew_lambda`"
            ));
        };
        map.insert("kd_objective".into(), objective.into());
    }
    if let Some(v) = map.remove("seq_kd") {
        match v.as_bool() {
            Some(false) => {}
            Some(true) => {
                return Err(
                    "`seq_kd: true` (train on the teacher's generations) is not done by \
                            the distill pipeline, which trains on the dataset's answers: the \
                            speculator pipeline trains on the teacher's generations"
                        .into(),
                );
            }
            None => {
                return Err(format!(
                    "`seq_kd`: expected true or false, got {}",
                    yaml_text(&v)
                ));
            }
        }
    }
    Ok(())
}

/// The configuration as YAML, every key with its value (what `--dry_run` prints).
pub fn to_yaml(config: &DistillConfig) -> String {
    serde_yaml::to_string(config).expect("the configuration serialises")
}

fn yaml_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_string(),
    }
}

/// Deep-merges `over` into `base` (mappings merge key by key; anything else replaces).
fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

fn get<'a>(root: &'a Value, path: &[&str]) -> Option<&'a Value> {
    let mut v = root;
    for k in path {
        v = v.as_mapping()?.get(*k)?;
    }
    Some(v)
}

fn set(root: &mut Value, path: &[&str], value: Value) {
    let mut v = root;
    for (i, k) in path.iter().enumerate() {
        if !v.is_mapping() {
            *v = Value::Mapping(Mapping::new());
        }
        let map = v.as_mapping_mut().expect("made a mapping");
        if i + 1 == path.len() {
            map.insert(Value::String(k.to_string()), value);
            return;
        }
        v = map
            .entry(Value::String(k.to_string()))
            .or_insert_with(|| Value::Mapping(Mapping::new()));
    }
}

/// One Hydra override.
fn apply_override(
    root: &mut Value,
    text: &str,
    schema: &Section,
) -> std::result::Result<(), String> {
    if let Some(key) = text.strip_prefix('~') {
        let key = key.split('=').next().unwrap_or(key);
        let path: Vec<&str> = key.split('.').collect();
        let (last, parent) = path.split_last().ok_or("empty key")?;
        let parent = parent
            .iter()
            .try_fold(&mut *root, |v, k| v.as_mapping_mut()?.get_mut(*k));
        return match parent.and_then(|p| p.as_mapping_mut()?.remove(*last)) {
            Some(_) => Ok(()),
            None => Err(format!("there is no `{key}` to remove")),
        };
    }
    let (mode, rest) = if let Some(r) = text.strip_prefix("++") {
        (2, r)
    } else if let Some(r) = text.strip_prefix('+') {
        (1, r)
    } else {
        (0, text)
    };
    let (key, raw) = rest
        .split_once('=')
        .ok_or("expected `key=value` (or `+key=value` to add a key)")?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err("empty key".into());
    }
    let value: Value = if raw.trim().is_empty() {
        Value::String(String::new())
    } else {
        serde_yaml::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
    };
    let path: Vec<&str> = key.split('.').collect();
    let exists = get(root, &path).is_some();
    if mode == 1 && exists {
        return Err(format!(
            "`{key}` is already in the configuration: use `{key}=…` to change it (or `++{key}=…`)"
        ));
    }
    // Without `+`, Hydra refuses a key the configuration does not have; a key this
    // toolkit or ROLL knows (with a default) is there in effect.
    if mode == 0 && !exists && !schema.knows(&path) {
        return Err(format!(
            "`{key}` is not in the configuration; to add it write `+{key}={raw}`"
        ));
    }
    set(root, &path, value);
    Ok(())
}

/// The keys of one level of the configuration.
struct Section {
    /// Keys this toolkit reads.
    ours: Vec<String>,
    /// Keys ROLL accepts at this level.
    roll: &'static [&'static str],
    /// Nested sections this toolkit reads.
    children: Vec<(&'static str, Section)>,
}

fn field_names<T: serde::Serialize>(value: &T) -> Vec<String> {
    match serde_yaml::to_value(value) {
        Ok(Value::Mapping(m)) => m
            .keys()
            .filter_map(|k| k.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    }
}

impl Section {
    fn top() -> Self {
        Self {
            ours: field_names(&DistillConfig::default()),
            roll: roll_keys::TOP_LEVEL,
            children: vec![
                ("student", Self::worker()),
                ("teacher", Self::worker()),
                ("validation", Self::worker()),
            ],
        }
    }

    fn worker() -> Self {
        let w = WorkerConfig::default();
        let leaf = |ours: Vec<String>, roll| Self {
            ours,
            roll,
            children: Vec::new(),
        };
        Self {
            ours: field_names(&w),
            roll: roll_keys::WORKER,
            children: vec![
                (
                    "model_args",
                    leaf(field_names(&w.model_args), roll_keys::MODEL_ARGS),
                ),
                (
                    "training_args",
                    leaf(field_names(&w.training_args), roll_keys::TRAINING_ARGS),
                ),
                (
                    "data_args",
                    leaf(field_names(&w.data_args), roll_keys::DATA_ARGS),
                ),
            ],
        }
    }

    fn child(&self, key: &str) -> Option<&Section> {
        self.children
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, s)| s)
    }

    /// Whether a key path is one this toolkit or ROLL knows.
    fn knows(&self, path: &[&str]) -> bool {
        let Some((first, rest)) = path.split_first() else {
            return true;
        };
        match self.child(first) {
            Some(child) => child.knows(rest),
            None => self.ours.iter().any(|k| k == first) || self.roll.contains(first),
        }
    }
}

/// Keeps the keys this toolkit reads, warns about (and drops) ROLL's others, and refuses the
/// rest with the nearest valid key.
fn check_keys(
    value: &mut Value,
    section: &Section,
    prefix: &str,
    warnings: &mut Vec<String>,
) -> std::result::Result<(), String> {
    let Some(map) = value.as_mapping_mut() else {
        return Ok(());
    };
    let keys: Vec<Value> = map.keys().cloned().collect();
    for k in keys {
        let Some(name) = k.as_str().map(str::to_string) else {
            return Err(format!("`{prefix}{}`: keys must be strings", yaml_text(&k)));
        };
        let path = format!("{prefix}{name}");
        if section.ours.contains(&name) {
            if let Some(child) = section.child(&name)
                && let Some(v) = map.get_mut(&k)
            {
                check_keys(v, child, &format!("{path}."), warnings)?;
            }
        } else if section.roll.contains(&name.as_str()) {
            let is_null = map.get(&k).is_some_and(Value::is_null);
            if !is_null {
                warnings.push(format!(
                    "`{path}` (a ROLL key) has no meaning here and is ignored"
                ));
            }
            map.remove(&k);
        } else {
            let candidates = section
                .ours
                .iter()
                .map(String::as_str)
                .chain(section.roll.iter().copied());
            return Err(match nearest(&name, candidates) {
                Some(near) => format!(
                    "`{path}`: unknown key (neither ROLL nor this toolkit has it); did you mean \
                     `{prefix}{near}`?"
                ),
                None => format!("`{path}`: unknown key (neither ROLL nor this toolkit has it)"),
            });
        }
    }
    Ok(())
}

/// The candidate closest to `name` by edit distance, when it is close enough to be a typo.
fn nearest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|c| (strsim::damerau_levenshtein(name, c), c))
        .min()
        .filter(|(d, c)| *d <= (name.len().max(c.len()) / 3).max(2))
        .map(|(_, c)| c)
}

/// Resolves `${…}` interpolations in `value` against `root`.
fn resolve(
    value: &mut Value,
    root: &Value,
    path: &str,
    depth: usize,
) -> std::result::Result<(), String> {
    if depth > 32 {
        return Err(format!("`{path}`: interpolation nests too deep (a cycle?)"));
    }
    match value {
        Value::Mapping(m) => {
            for (k, v) in m.iter_mut() {
                let p = format!(
                    "{path}{}{}",
                    if path.is_empty() { "" } else { "." },
                    yaml_text(k)
                );
                resolve(v, root, &p, depth)?;
            }
        }
        Value::Sequence(s) => {
            for (i, v) in s.iter_mut().enumerate() {
                resolve(v, root, &format!("{path}[{i}]"), depth)?;
            }
        }
        Value::String(s) if s.contains("${") => {
            let text = s.clone();
            let whole =
                text.starts_with("${") && text.ends_with('}') && text.matches("${").count() == 1;
            if whole {
                let mut v = lookup(&text[2..text.len() - 1], root, path)?;
                resolve(&mut v, root, path, depth + 1)?;
                *value = v;
            } else {
                let mut out = String::new();
                let mut rest = text.as_str();
                while let Some(start) = rest.find("${") {
                    out.push_str(&rest[..start]);
                    let end = rest[start..]
                        .find('}')
                        .ok_or_else(|| format!("`{path}`: unclosed `${{` in `{text}`"))?;
                    let mut v = lookup(&rest[start + 2..start + end], root, path)?;
                    resolve(&mut v, root, path, depth + 1)?;
                    out.push_str(&yaml_text(&v));
                    rest = &rest[start + end + 1..];
                }
                out.push_str(rest);
                *value = Value::String(out);
            }
        }
        _ => {}
    }
    Ok(())
}

fn lookup(expr: &str, root: &Value, at: &str) -> std::result::Result<Value, String> {
    let expr = expr.trim();
    if let Some(args) = expr.strip_prefix("oc.env:") {
        let (var, default) = match args.split_once(',') {
            Some((v, d)) => (v.trim(), Some(d.trim())),
            None => (args.trim(), None),
        };
        return match (std::env::var(var), default) {
            (Ok(v), _) => Ok(Value::String(v)),
            (Err(_), Some(d)) => Ok(serde_yaml::from_str(d).unwrap_or(Value::String(d.into()))),
            (Err(_), None) => Err(format!(
                "`{at}`: environment variable `{var}` (in `${{oc.env:{var}}}`) is not set"
            )),
        };
    }
    if expr.contains(':') {
        return Err(format!(
            "`{at}`: the resolver in `${{{expr}}}` is not supported (only `oc.env` and key paths)"
        ));
    }
    let path: Vec<&str> = expr.split('.').collect();
    get(root, &path).cloned().ok_or_else(|| {
        format!("`{at}`: `${{{expr}}}` refers to `{expr}`, which the configuration does not have")
    })
}

#[cfg(test)]
mod tests;
