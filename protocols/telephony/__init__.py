"""Phone calls: telephony providers' media-streaming WebSockets onto the voice
conversation (`protocols.realtime.Conversation`). `twilio`: Twilio Media Streams
(`<Connect><Stream url="wss://…/v1/telephony/twilio">`)."""
