"""The application: the jmp-policy command, its demo and doctors."""
