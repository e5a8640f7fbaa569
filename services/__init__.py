"""kvbus services: one actor per role, plus the engine package they share."""
