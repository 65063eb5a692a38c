defmodule EMLXAxon.Hub.HTTP do
  @moduledoc false
  # HTTP for EMLXAxon.Hub on OTP's :httpc alone: certificates checked
  # against the system store, redirects followed here (so the bearer token
  # never travels to another host, such as the Hub's file CDN), and bodies
  # streamed chunk by chunk to a callback, with an idle timeout.

  @max_redirects 8
  @connect_timeout 30_000

  @typedoc "Response headers: lower-case names to values."
  @type headers :: %{String.t() => String.t()}

  @doc false
  # Starts what :httpc needs; {:error, message} when TLS cannot be set up.
  @spec ensure_started(String.t()) :: :ok | {:error, String.t()}
  def ensure_started(url) do
    apps = if https?(url), do: [:crypto, :public_key, :ssl, :inets], else: [:inets]

    Enum.reduce_while(apps, :ok, fn app, :ok ->
      case Application.ensure_all_started(app) do
        {:ok, _} -> {:cont, :ok}
        {:error, reason} -> {:halt, {:error, "could not start #{app}: #{inspect(reason)}"}}
      end
    end)
    |> case do
      :ok -> ssl_check(url)
      error -> error
    end
  end

  defp ssl_check(url) do
    if https?(url) do
      case cacerts() do
        {:ok, _} -> :ok
        {:error, _} = error -> error
      end
    else
      :ok
    end
  end

  @doc false
  # A request whose whole body is wanted (an API listing, a HEAD).
  # Redirects are followed only with `follow: true`.
  @spec request(:get | :head, String.t(), [{String.t(), String.t()}], keyword()) ::
          {:ok, non_neg_integer(), headers(), binary()} | {:error, term()}
  def request(method, url, headers, opts \\ []) do
    follow? = Keyword.get(opts, :follow, true)
    timeout = Keyword.get(opts, :timeout, 60_000)
    do_request(method, url, headers, follow?, timeout, @max_redirects)
  end

  defp do_request(method, url, headers, follow?, timeout, redirects_left) do
    with {:ok, http_opts} <- http_options(url, timeout) do
      request = {String.to_charlist(url), charlist_headers(headers)}

      case :httpc.request(method, request, http_opts, body_format: :binary) do
        {:ok, {{_, status, _}, resp_headers, body}} ->
          resp_headers = headers_map(resp_headers)

          case redirect(status, resp_headers, url, headers) do
            {:redirect, next_url, next_headers} when follow? and redirects_left > 0 ->
              do_request(method, next_url, next_headers, follow?, timeout, redirects_left - 1)

            {:redirect, _, _} when follow? ->
              {:error, :too_many_redirects}

            _ ->
              {:ok, status, resp_headers, body}
          end

        {:error, reason} ->
          {:error, reason}
      end
    end
  end

  @doc false
  # Streams a GET's body: `fun.({:start, status, headers}, acc)` once a 200
  # or 206 answer starts, then `fun.({:data, chunk}, acc)` per chunk.
  # Returns {:done, acc} when the body is complete, {:status, status,
  # headers, body} for any other answer, or {:error, reason, acc} when the
  # connection fails or stays idle for `idle_timeout` ms.
  @spec stream(String.t(), [{String.t(), String.t()}], non_neg_integer(), term(), fun()) ::
          {:done, term()}
          | {:status, non_neg_integer(), headers(), binary()}
          | {:error, term(), term()}
  def stream(url, headers, idle_timeout, acc, fun) do
    stream(url, headers, idle_timeout, acc, fun, @max_redirects)
  end

  defp stream(url, headers, idle_timeout, acc, fun, redirects_left) do
    case http_options(url, :infinity) do
      {:ok, http_opts} ->
        request = {String.to_charlist(url), charlist_headers(headers)}
        options = [sync: false, stream: {:self, :once}, body_format: :binary]

        case :httpc.request(:get, request, http_opts, options) do
          {:ok, ref} ->
            case receive_stream(ref, nil, idle_timeout, acc, fun) do
              {:status, status, resp_headers, body} ->
                case redirect(status, resp_headers, url, headers) do
                  {:redirect, next_url, next_headers} when redirects_left > 0 ->
                    stream(next_url, next_headers, idle_timeout, acc, fun, redirects_left - 1)

                  {:redirect, _, _} ->
                    {:error, :too_many_redirects, acc}

                  :none ->
                    {:status, status, resp_headers, body}
                end

              other ->
                other
            end

          {:error, reason} ->
            {:error, reason, acc}
        end

      {:error, reason} ->
        {:error, reason, acc}
    end
  end

  defp receive_stream(ref, pid, idle_timeout, acc, fun) do
    receive do
      {:http, {^ref, :stream_start, headers, pid}} ->
        headers = headers_map(headers)
        status = if Map.has_key?(headers, "content-range"), do: 206, else: 200
        acc = fun.({:start, status, headers}, acc)
        :ok = :httpc.stream_next(pid)
        receive_stream(ref, pid, idle_timeout, acc, fun)

      {:http, {^ref, :stream, chunk}} ->
        acc = fun.({:data, chunk}, acc)
        :ok = :httpc.stream_next(pid)
        receive_stream(ref, pid, idle_timeout, acc, fun)

      {:http, {^ref, :stream_end, _headers}} ->
        {:done, acc}

      {:http, {^ref, {{_, status, _}, headers, body}}} ->
        {:status, status, headers_map(headers), body}

      {:http, {^ref, {:error, reason}}} ->
        {:error, reason, acc}
    after
      idle_timeout ->
        :httpc.cancel_request(ref)
        flush(ref)
        {:error, :timeout, acc}
    end
  end

  defp flush(ref) do
    receive do
      {:http, {^ref, _}} -> flush(ref)
      {:http, {^ref, _, _}} -> flush(ref)
      {:http, {^ref, _, _, _}} -> flush(ref)
    after
      0 -> :ok
    end
  end

  # The next hop of a redirect: relative locations resolve against the
  # current URL; the Authorization header goes only to the same origin.
  defp redirect(status, headers, url, req_headers) when status in [301, 302, 303, 307, 308] do
    case headers["location"] do
      nil ->
        :none

      location ->
        next = url |> URI.merge(location) |> URI.to_string()

        req_headers =
          if origin(next) == origin(url),
            do: req_headers,
            else:
              Enum.reject(req_headers, fn {name, _} ->
                String.downcase(name) == "authorization"
              end)

        {:redirect, next, req_headers}
    end
  end

  defp redirect(_status, _headers, _url, _req_headers), do: :none

  defp origin(url) do
    uri = URI.parse(url)
    {uri.scheme, uri.host, uri.port}
  end

  defp http_options(url, timeout) do
    base = [timeout: timeout, connect_timeout: @connect_timeout, autoredirect: false]

    if https?(url) do
      with {:ok, cacerts} <- cacerts() do
        {:ok, [{:ssl, ssl_options(cacerts)} | base]}
      end
    else
      {:ok, base}
    end
  end

  defp ssl_options(cacerts) do
    [
      verify: :verify_peer,
      cacerts: cacerts,
      depth: 4,
      customize_hostname_check: [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]
    ]
  end

  # The operating system's CA store (OTP 25+).
  defp cacerts do
    if function_exported?(:public_key, :cacerts_get, 0) do
      try do
        {:ok, apply(:public_key, :cacerts_get, [])}
      rescue
        error ->
          {:error,
           "could not read the system's CA certificates to verify https connections " <>
             "(#{Exception.message(error)}); install the ca-certificates package"}
      end
    else
      {:error,
       "https downloads verify certificates against the system's CA store, which needs " <>
         "Erlang/OTP 25 or later (:public_key.cacerts_get/0); this is OTP " <>
         "#{:erlang.system_info(:otp_release)}"}
    end
  end

  defp https?(url), do: String.starts_with?(url, "https://")

  defp charlist_headers(headers) do
    for {name, value} <- headers, do: {String.to_charlist(name), String.to_charlist(value)}
  end

  defp headers_map(headers) do
    Map.new(headers, fn {name, value} ->
      {name |> to_string() |> String.downcase(), to_string(value)}
    end)
  end
end
