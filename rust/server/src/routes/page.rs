//! The chat page at `/`: plain HTML, CSS and JavaScript compiled into the binary (no CDN, no build
//! step), talking to this server's own `/v1/models` and streaming `/v1/chat/completions`.
//!
//! The page itself needs no API key: it holds no data, and it asks the person for the key, which it
//! sends as `Authorization: Bearer` on its API calls like any other client.

use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

const HTML: &str = include_str!("../../assets/chat.html");
const CSS: &str = include_str!("../../assets/chat.css");
const JS: &str = include_str!("../../assets/chat.js");

/// Only this server's own scripts, styles and API: an injected script or a third-party fetch fails.
const POLICY: &str = "default-src 'self'; connect-src 'self'; img-src 'self' data:; \
                      base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// An embedded asset with its type. `no-cache` makes a browser revalidate, so a new binary's page
/// is picked up at once.
fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "no-cache"),
            (CONTENT_SECURITY_POLICY, POLICY),
        ],
        body,
    )
}

/// `GET /`, `GET /assets/chat.css`, `GET /assets/chat.js`; they need no state.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", HTML) }),
        )
        .route(
            "/assets/chat.css",
            get(|| async { asset("text/css; charset=utf-8", CSS) }),
        )
        .route(
            "/assets/chat.js",
            get(|| async { asset("text/javascript; charset=utf-8", JS) }),
        )
}

#[cfg(test)]
mod tests {
    use axum::body::{to_bytes, Body};
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt as _;

    use super::*;

    async fn fetch(path: &str) -> (StatusCode, String, String) {
        let response = router::<()>()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_string();
        let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (
            status,
            content_type,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn page_and_its_assets_are_served_from_the_binary() {
        let (status, content_type, html) = fetch("/").await;
        assert_eq!(status, StatusCode::OK);
        assert!(content_type.starts_with("text/html"), "{content_type}");
        // Every asset the page links is one this router serves, and nothing comes from elsewhere.
        for link in ["/assets/chat.css", "/assets/chat.js"] {
            assert!(
                html.contains(&format!("\"{link}\"")),
                "page does not link {link}"
            );
            let (status, _, body) = fetch(link).await;
            assert_eq!(status, StatusCode::OK, "{link}");
            assert!(!body.is_empty());
        }
        assert!(!html.contains("http://") && !html.contains("https://"));
        let (_, content_type, js) = fetch("/assets/chat.js").await;
        assert!(content_type.starts_with("text/javascript"));
        assert!(js.contains("/v1/chat/completions") && js.contains("/v1/models"));
        assert!(js.contains("Authorization: `Bearer ${key}`"));
    }
}
