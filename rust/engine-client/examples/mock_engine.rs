//! Standalone fake EngineCore for benchmarks: `mock_engine --input-address A --output-address B
//! [--engine-index 0] [--step-interval-us 1000] [--tokens-per-step 1] [--max-model-len 4096]`.
//! Generated tokens echo the prompt; it runs until killed.

use std::time::Duration;

use voltllm_engine_client::mock::{MockEngine, MockEngineConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let required = |name: &str| get(name).ok_or_else(|| format!("missing {name}"));
    let mut config =
        MockEngineConfig::new(required("--input-address")?, required("--output-address")?);
    if let Some(v) = get("--engine-index") {
        config.engine_index = v.parse()?;
    }
    if let Some(v) = get("--step-interval-us") {
        config.step_interval = Duration::from_micros(v.parse()?);
    }
    if let Some(v) = get("--tokens-per-step") {
        config.tokens_per_step = v.parse()?;
    }
    if let Some(v) = get("--max-model-len") {
        config.max_model_len = v.parse()?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let _engine = MockEngine::start(config).await?;
        std::future::pending::<()>().await;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
