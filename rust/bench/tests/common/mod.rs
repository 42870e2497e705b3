pub mod mock_server;
