"""The engine link: the engine process, its client in the front end, the messages between them, and the runner that starts both."""
