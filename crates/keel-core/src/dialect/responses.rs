//! See the parent module (`crate::dialect`).
// Interim: the dialect's translation lands with its own module; until then it cannot serve.
use serde_json::{Map, Value};

use super::{DialectRequest, StreamToHub};
use crate::request::RequestError;

const MISSING: &str = "this dialect is not available in this build";

pub fn request(_hub: &Map<String, Value>) -> Result<DialectRequest, RequestError> {
    Err(RequestError::invalid(MISSING))
}

pub fn whole(_body: &[u8], _model: &str) -> Result<Vec<u8>, String> {
    Err(MISSING.into())
}

pub struct Stream;

impl StreamToHub for Stream {
    fn feed(&mut self, _chunk: &[u8], _out: &mut Vec<u8>) -> Result<(), String> {
        Err(MISSING.into())
    }
    fn end(&mut self, _out: &mut Vec<u8>) -> Result<(), String> {
        Err(MISSING.into())
    }
}

impl Stream {
    pub fn new(_model: &str, _include_usage: bool) -> Stream {
        Stream
    }
}

pub fn error(_status: u16, body: &[u8]) -> Vec<u8> {
    body.to_vec()
}
