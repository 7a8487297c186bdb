//! See the parent module (`crate::dialect`).
// Interim: Azure's answers pass through unchanged until its own module lands.
use super::StreamToHub;

pub struct Stream;

impl Stream {
    pub fn new() -> Stream {
        Stream
    }
}

impl StreamToHub for Stream {
    fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        out.extend_from_slice(chunk);
        Ok(())
    }
    fn end(&mut self, _out: &mut Vec<u8>) -> Result<(), String> {
        Ok(())
    }
}

pub fn whole(body: &[u8]) -> Result<Vec<u8>, String> {
    Ok(body.to_vec())
}
