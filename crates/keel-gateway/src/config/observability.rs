//! `[log]` (the access log and keel's own log lines) and `[telemetry]` (OpenTelemetry traces).
//!
//! ```toml
//! [log]
//! format = "json"        # or "text": the access log and keel's own log lines
//! access = "stdout"      # "stderr", "off", or a file path (appended to, one line per request)
//!
//! [telemetry]
//! otlp_endpoint = "http://127.0.0.1:4318"   # OTLP/HTTP base; spans go to {endpoint}/v1/traces
//! service_name = "keel"
//! ```

use std::path::PathBuf;

use super::read::{Issues, Table};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One JSON object per line.
    #[default]
    Json,
    /// `key=value` pairs, for people reading a terminal.
    Text,
}

impl LogFormat {
    /// Parses a `--log-format` value.
    pub fn parse(s: &str) -> Option<LogFormat> {
        FORMATS.iter().find(|(n, _)| *n == s).map(|(_, f)| *f)
    }
}

/// Where the access log goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum AccessLogTarget {
    #[default]
    Stdout,
    Stderr,
    Off,
    /// Appended to, one line per request.
    File(PathBuf),
}

/// `[log]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    pub access: AccessLogTarget,
}

/// `[telemetry]`: traces are exported only when `otlp_endpoint` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// OTLP/HTTP base URL (`/v1/traces` is appended).
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "keel".into(),
        }
    }
}

const FORMATS: [(&str, LogFormat); 2] = [("json", LogFormat::Json), ("text", LogFormat::Text)];

pub(super) fn read_log(t: Option<Table>, issues: &mut Issues) -> LogConfig {
    let Some(mut t) = t else {
        return LogConfig::default();
    };
    let format = t
        .choice("format", &FORMATS, issues)
        .map(|v| v.value)
        .unwrap_or_default();
    let access = match t.get::<String>("access", issues) {
        None => AccessLogTarget::default(),
        Some(v) => match v.value.as_str() {
            "stdout" => AccessLogTarget::Stdout,
            "stderr" => AccessLogTarget::Stderr,
            "off" => AccessLogTarget::Off,
            "" => {
                issues.report(
                    v.at,
                    &v.path,
                    "expected \"stdout\", \"stderr\", \"off\" or a file path, got an empty string",
                );
                AccessLogTarget::default()
            }
            path => AccessLogTarget::File(PathBuf::from(path)),
        },
    };
    t.finish(issues);
    LogConfig { format, access }
}

pub(super) fn read_telemetry(t: Option<Table>, issues: &mut Issues) -> TelemetryConfig {
    let Some(mut t) = t else {
        return TelemetryConfig::default();
    };
    let otlp_endpoint = t.get::<String>("otlp_endpoint", issues).and_then(|v| {
        let base = v.value.trim_end_matches('/');
        let valid = (base.starts_with("http://") || base.starts_with("https://"))
            && base.parse::<http::Uri>().is_ok();
        if !valid {
            issues.report(
                v.at,
                &v.path,
                format!(
                    "expected an OTLP/HTTP base URL such as \"http://127.0.0.1:4318\", got {:?}",
                    v.value
                ),
            );
            return None;
        }
        Some(base.to_owned())
    });
    let service_name = t
        .value::<String>("service_name", issues)
        .unwrap_or_else(|| "keel".into());
    t.finish(issues);
    TelemetryConfig {
        otlp_endpoint,
        service_name,
    }
}
