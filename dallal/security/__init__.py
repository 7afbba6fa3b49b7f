"""Who may connect and what they may do: password files, cred checkers, access control lists."""
