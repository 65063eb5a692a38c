//! On/off switches read from the environment.

/// `name` set to `1` or `true`.
pub(crate) fn on(name: &str) -> bool {
    matches!(std::env::var(name).as_deref(), Ok("1") | Ok("true"))
}

/// `name` set to `0` or `false`.
pub(crate) fn off(name: &str) -> bool {
    matches!(std::env::var(name).as_deref(), Ok("0") | Ok("false"))
}
