"""Python clients for omni-rt's wire protocols.

This package talks to the server over the wire only; it never imports the server's
own packages (omni_rt, sessions, protocols, pipelines).
"""

from clients.tts import SpeechError, SpeechResult, speak

__all__ = ["SpeechError", "SpeechResult", "speak"]
