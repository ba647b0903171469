//! Resource files as local mode reads them: any YAML text, several documents, every kind.
#![no_main]

use custody::local::Resources;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(resources) = Resources::parse(std::path::Path::new("fuzz.yaml"), text) {
        let _ = resources.targets();
        let _ = resources.server_configs();
    }
});
