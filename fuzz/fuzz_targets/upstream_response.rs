#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| keel_gateway::fuzzing::upstream_response(data));
