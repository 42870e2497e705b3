pub mod harness;
pub mod mock_server;
