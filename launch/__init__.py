"""Command line (`distengine ...`) and cluster start-up."""
