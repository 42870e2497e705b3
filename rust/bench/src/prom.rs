//! The server's Prometheus `/metrics`, scraped before and after a run so a result also records what
//! the server saw (queueing, prefix-cache hits, preemptions, ...).

use std::collections::BTreeMap;

/// Samples of one scrape: `name{labels}` exactly as exposed → value.
pub type Samples = BTreeMap<String, f64>;

/// Parses the Prometheus text exposition format. Comment lines and samples whose value is not a
/// number are skipped; an optional trailing timestamp is ignored.
pub fn parse(text: &str) -> Samples {
    let mut out = Samples::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        // Label values may contain spaces, so split after the closing brace when there is one.
        let (series, rest) = match line.rfind('}') {
            Some(end) => (&line[..=end], &line[end + 1..]),
            None => match line.split_once(char::is_whitespace) {
                Some((s, r)) => (s, r),
                None => continue,
            },
        };
        let Some(value) = rest.split_whitespace().next() else {
            continue;
        };
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => match v.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            },
        };
        out.insert(series.trim().to_string(), value);
    }
    out
}

/// GETs `{base_url}/metrics`; `None` when the server has no such route or cannot be reached.
pub async fn scrape(
    client: &reqwest::Client,
    base_url: &str,
    api_key: Option<&str>,
) -> Option<Samples> {
    let mut req = client
        .get(format!("{base_url}/metrics"))
        .timeout(std::time::Duration::from_secs(10));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    Some(parse(&resp.text().await.ok()?))
}

/// `after − before` for every series present in both (counters become per-run amounts).
pub fn delta(before: &Samples, after: &Samples) -> Samples {
    after
        .iter()
        .filter_map(|(k, a)| before.get(k).map(|b| (k.clone(), a - b)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_text_format() {
        let text = "# HELP x help\n# TYPE x counter\nx_total 3\nlat_bucket{le=\"0.5\",m=\"a b\"} 7 1700000000\n\
                    lat_bucket{le=\"+Inf\"} +Inf\nbroken\nweird_value NaNx\n";
        let s = parse(text);
        assert_eq!(s.get("x_total"), Some(&3.0));
        assert_eq!(s.get("lat_bucket{le=\"0.5\",m=\"a b\"}"), Some(&7.0));
        assert_eq!(s.get("lat_bucket{le=\"+Inf\"}"), Some(&f64::INFINITY));
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn delta_subtracts_common_series() {
        let b = parse("a 1\nb 5\n");
        let a = parse("a 4\nc 2\n");
        let d = delta(&b, &a);
        assert_eq!(d.get("a"), Some(&3.0));
        assert_eq!(d.len(), 1);
    }
}
