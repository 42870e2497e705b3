//! `voltllm._core`: the Rust halves of voltllm, exposed to Python.
//!
//! One implementation of text handling serves HTTP and Python alike: the offline `LLM` API tokenizes,
//! renders chat templates and detokenizes through these classes, exactly as the server does.

mod serve;
mod text;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<text::Tokenizer>()?;
    m.add_class::<text::ChatTemplate>()?;
    m.add_class::<text::Detokenizer>()?;
    m.add_function(wrap_pyfunction!(text::detokenize_step, m)?)?;
    m.add_function(wrap_pyfunction!(serve::serve, m)?)?;
    m.add_function(wrap_pyfunction!(serve::bench_main, m)?)?;
    // The names `--tool-call-parser` and `--reasoning-parser` accept, defined once (in the server).
    m.add(
        "TOOL_CALL_PARSERS",
        voltllm_server::tools::TOOL_PARSER_NAMES.to_vec(),
    )?;
    m.add(
        "REASONING_PARSERS",
        voltllm_server::reasoning::REASONING_PARSER_NAMES.to_vec(),
    )?;
    Ok(())
}
