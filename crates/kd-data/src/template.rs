//! Chat templates: the model's own Jinja template (from `tokenizer_config.json` or
//! `chat_template.jinja`) rendered with `minijinja` the way transformers renders it
//! (`trim_blocks`, `lstrip_blocks`, no trailing newline, the helpers HF templates use), so that
//! token ids equal `tokenizer.apply_chat_template` exactly.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::error::{DataError, Result};
use crate::source::Message;

const NAME: &str = "chat_template";

/// A compiled chat template with the special-token strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: BTreeMap<String, String>,
    source: String,
    variables: BTreeMap<String, serde_json::Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .field("variables", &self.variables)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a template. `special_tokens` maps names such as `bos_token` and `eos_token`
    /// to their text (transformers passes every special token of the tokenizer).
    pub fn new(source: &str, special_tokens: BTreeMap<String, String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| DataError::Template(describe(&e)))?;
        Ok(Self {
            env,
            special_tokens,
            source: source.to_string(),
            variables: BTreeMap::new(),
        })
    }

    /// Sets variables that every rendering sees, as transformers'
    /// `apply_chat_template(messages, **kwargs)` and vLLM's / SGLang's `chat_template_kwargs`
    /// pass them: e.g. Qwen3's `{"enable_thinking": false}` (absent, the template's own
    /// default applies, as in transformers). A variable given to
    /// [`render_json`](Self::render_json) overrides one set here. `messages` and
    /// `add_generation_prompt` cannot be set this way.
    pub fn with_variables(
        mut self,
        variables: BTreeMap<String, serde_json::Value>,
    ) -> Result<Self> {
        if let Some(k) = variables
            .keys()
            .find(|k| matches!(k.as_str(), "messages" | "add_generation_prompt"))
        {
            return Err(DataError::Template(format!(
                "chat template variable `{k}` is set by the renderer itself and cannot be given                  as a template variable"
            )));
        }
        self.variables = variables;
        Ok(self)
    }

    /// The variables set with [`with_variables`](Self::with_variables).
    pub fn variables(&self) -> &BTreeMap<String, serde_json::Value> {
        &self.variables
    }

    /// The template's Jinja source (for cache keys: a changed template changes the prompts).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// What decides the rendered text besides the messages, for cache keys: the source, and
    /// the variables where any are set (so that a template without variables keys as its
    /// source alone).
    pub fn identity(&self) -> String {
        if self.variables.is_empty() {
            self.source.clone()
        } else {
            let vars = serde_json::to_string(&self.variables).expect("JSON values serialise");
            format!("{}\n{{# variables: {vars} #}}", self.source)
        }
    }

    /// Renders `messages` (a JSON list of `{role, content, …}` objects, as in the OpenAI
    /// format) with `add_generation_prompt` and extra variables (`date_string`, `tools`, …).
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &BTreeMap<String, serde_json::Value>,
    ) -> Result<String> {
        // transformers refuses this before rendering (`apply_chat_template`).
        if messages.as_array().is_some_and(Vec::is_empty) {
            return Err(DataError::Template(
                "cannot apply the chat template to an empty conversation: give at least one \
                 message"
                    .into(),
            ));
        }
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| DataError::Template(describe(&e)))?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::from(v.clone()));
        }
        for (k, v) in self.variables.iter().chain(extra) {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        tmpl.render(Value::from(ctx))
            .map_err(|e| DataError::Template(describe(&e)))
    }

    /// Renders a conversation of text messages.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let json = serde_json::to_value(messages).expect("messages serialise");
        self.render_json(&json, add_generation_prompt, &BTreeMap::new())
    }
}

fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time (transformers uses local time; render with
/// an explicit `date_string` for reproducible prompts).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &format)
}

/// A subset of C `strftime` for a UTC timestamp: %Y %y %m %d %-d %e %B %b %A %a %H %M %S %j %%.
pub(crate) fn strftime(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next().unwrap_or('%');
        let no_pad = spec == '-';
        if no_pad {
            spec = chars.next().unwrap_or('%');
        }
        let two = |v: i64| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:02}")
            }
        };
        match spec {
            'Y' => out.push_str(&y.to_string()),
            'y' => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            'm' => out.push_str(&two(m)),
            'd' => out.push_str(&two(d)),
            'e' => out.push_str(&format!("{d:>2}")),
            'B' => out.push_str(month),
            'b' | 'h' => out.push_str(&month[..3]),
            'A' => out.push_str(weekday),
            'a' => out.push_str(&weekday[..3]),
            'H' => out.push_str(&two(secs / 3600)),
            'M' => out.push_str(&two(secs / 60 % 60)),
            'S' => out.push_str(&two(secs % 60)),
            'j' => out.push_str(&format!("{yday:03}")),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

/// `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=indent)` — keys in insertion order, `", "`/`": "` separators (`","` with an indent),
/// no HTML escaping (minijinja's own `tojson` escapes `<`, `>`, `&`, `'`).
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn py_json(
    v: &Value,
    indent: Option<usize>,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let x = f64::try_from(v.clone())?;
                out.push_str(&py_float(x));
            }
        }
        ValueKind::String => py_string(v.as_str().unwrap_or_default(), out),
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                py_string(&key, out);
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(item, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        _ => py_string(&v.to_string(), out),
    }
    Ok(())
}

fn py_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 or from 1e16.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let exp = if x == 0.0 {
        0
    } else {
        x.abs().log10().floor() as i32
    };
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let s = format!("{x:e}");
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", e.abs())
    }
}

/// Reads the chat template and special tokens of a tokenizer directory: `chat_template` from
/// `tokenizer_config.json` (a string, or a list of named templates of which `default` is
/// taken) or from `chat_template.jinja` beside it.
pub fn load_template(dir: &Path) -> Result<Option<ChatTemplate>> {
    let config_path = dir.join("tokenizer_config.json");
    let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| DataError::Record {
            path: config_path.clone(),
            line: e.line(),
            record: None,
            reason: format!("invalid JSON: {e}"),
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
        Err(e) => return Err(DataError::io(&config_path, e)),
    };
    let source = match config.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    };
    let source = match source {
        Some(s) => Some(s),
        None => {
            let jinja = dir.join("chat_template.jinja");
            match std::fs::read_to_string(&jinja) {
                Ok(s) => Some(s),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(DataError::io(&jinja, e)),
            }
        }
    };
    let Some(source) = source else {
        return Ok(None);
    };
    ChatTemplate::new(&source, special_tokens(&config)).map(Some)
}

/// The special-token strings of a `tokenizer_config.json` (`bos_token`, `eos_token`,
/// `pad_token`, `unk_token`, …), given as strings or as `{"content": …}` objects.
pub fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(map) = config.as_object() {
        for (k, v) in map {
            if !k.ends_with("_token") {
                continue;
            }
            let text = match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string),
                _ => None,
            };
            if let Some(t) = text {
                out.insert(k.clone(), t);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-07-26 12:34:56 UTC was a Friday.
        let t = 1_721_997_296;
        assert_eq!(strftime(t, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            strftime(t, "%A %B %-d, %H:%M:%S %j %%"),
            "Friday July 26, 12:34:56 208 %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(strftime(951_782_400, "%Y-%m-%d"), "2000-02-29");
    }

    #[test]
    fn python_json() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}",
            BTreeMap::new(),
        )
        .unwrap();
        let x = serde_json::json!({"b": [1, 2.5, "é<&>'\"\n"], "a": {}, "c": null, "d": 1e-7, "e": 3.0});
        let mut extra = BTreeMap::new();
        extra.insert("x".to_string(), x);
        let out = t
            .render_json(
                &serde_json::json!([{"role": "user", "content": "hi"}]),
                false,
                &extra,
            )
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é<&>'\\\"\\n\"], \"a\": {}, \"c\": null, \"d\": 1e-07, \"e\": 3.0}|{\n  \"b\": [\n    1,\n    2.5,\n    \"é<&>'\\\"\\n\"\n  ],\n  \"a\": {},\n  \"c\": null,\n  \"d\": 1e-07,\n  \"e\": 3.0\n}"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t =
            ChatTemplate::new("{{ raise_exception('no system role') }}", BTreeMap::new()).unwrap();
        let one = [Message {
            role: "user".into(),
            content: "hi".into(),
        }];
        let e = t.render(&one, false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        // An empty conversation is refused before rendering, as transformers refuses it.
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("empty conversation"), "{e}");
        assert!(ChatTemplate::new("{% if %}", BTreeMap::new()).is_err());
    }
}
